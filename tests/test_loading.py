"""headbudget.loading: one loader for every model and tokenizer (folders, run folders, GGUF, kinds, precedence)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from conftest import assert_names, names
from headbudget.loading import (
    ModelSource,
    load_model,
    load_model_and_tokenizer,
    load_tokenizer,
    resolve_model,
)
from tiny_gguf import write_tiny_llama_gguf

CAHP = Path(__file__).resolve().parent / "fixtures" / "cahp"
TEXT = "the dogs that the cat chases run . = end marco = " * 20


def _headbudget(path: Path, vocab: int = 320) -> Path:
    from headbudget.models import HeadBudgetConfig, HeadBudgetForCausalLM
    from headbudget.schedules import prism

    torch.manual_seed(0)
    HeadBudgetForCausalLM(HeadBudgetConfig(schedule=prism(2, 32, 16, 8), vocab_size=vocab,
                                           n_positions=64)).save_pretrained(path)
    return path


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_tokenizer_precedence_explicit_root_legacy_run_folder(tmp_path):
    from headbudget.models.tokenizers import ByteTokenizer, make_tokenizer

    bpe = make_tokenizer("bpe:300", [TEXT])
    sample = "the cat chases the dogs ."
    model_dir = _headbudget(tmp_path / "run" / "model")
    ByteTokenizer().save(model_dir)                    # 2. the model folder's root
    bpe.save(model_dir / "tokenizer")                  # 3. the legacy subfolder
    bpe.save(tmp_path / "bpe_elsewhere")
    assert _ids(load_tokenizer(model_dir=model_dir), sample) == list(sample.encode())  # root beats legacy
    assert _ids(load_tokenizer(tmp_path / "bpe_elsewhere", model_dir=model_dir), sample) == bpe.encode(sample)
    assert _ids(load_tokenizer("byte"), sample) == list(sample.encode())
    for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer_spec.json"):
        (model_dir / f).unlink()
    assert _ids(load_tokenizer(model_dir=model_dir), sample) == bpe.encode(sample)     # then the legacy one
    # a run folder resolves to its model/; an old run kept the tokenizer only in run/tokenizer/
    import shutil

    shutil.move(str(model_dir / "tokenizer"), str(tmp_path / "run" / "tokenizer"))
    assert _ids(load_tokenizer(model_dir=tmp_path / "run"), sample) == bpe.encode(sample)
    shutil.rmtree(tmp_path / "run" / "tokenizer")
    with pytest.raises(ValueError, match=names(model_dir, "tokenizer")):
        load_tokenizer(model_dir=tmp_path / "run")
    with pytest.raises(ValueError, match=names("'bpe:300'", "BPE")):
        load_tokenizer("bpe:300")


def test_run_folder_opens_its_model(tmp_path):
    from headbudget.models.tokenizers import ByteTokenizer

    model_dir = _headbudget(tmp_path / "run" / "model")
    ByteTokenizer().save(model_dir)
    assert resolve_model(tmp_path / "run").where == model_dir
    model, tok = load_model_and_tokenizer(tmp_path / "run")
    direct = load_model(model_dir)
    x = torch.tensor([_ids(tok, "hello")])
    assert torch.equal(model(x).logits, direct(x).logits)
    assert type(model).__name__ == "HeadBudgetForCausalLM" and not model.training
    with pytest.raises(FileNotFoundError, match=names(tmp_path / "missing")):
        load_model(tmp_path / "missing")


def test_gguf_file_and_folder_open_with_the_embedded_tokenizer(tmp_path):
    ref = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    text = "héllo wörld"
    model, tok = load_model_and_tokenizer(tmp_path / "tiny.gguf")          # the file itself
    assert _ids(tok, text) == list(text.encode())                          # the GGUF-embedded tokenizer
    x = torch.tensor([_ids(tok, text)])
    assert (model(x).logits - ref(x).logits).abs().max() < 1e-5
    hb, _ = load_model_and_tokenizer(tmp_path, as_headbudget=True)          # a folder with one .gguf
    assert type(hb).__name__ == "HeadBudgetForCausalLM"
    assert (hb(x).logits - ref(x).logits).abs().max() < 1e-4
    (tmp_path / "other.gguf").write_bytes((tmp_path / "tiny.gguf").read_bytes())
    with pytest.raises(ValueError, match=names(tmp_path, "2", "other.gguf", "tiny.gguf")):
        load_model(tmp_path)
    assert resolve_model(tmp_path, gguf_file="other.gguf").gguf_file == "other.gguf"
    with pytest.raises(ValueError, match=names(tmp_path / "tiny.gguf", "GGUF", "classifier")):
        load_model(tmp_path / "tiny.gguf", "classifier", num_labels=2)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        BertModel,
        BertTokenizerFast,
        GPT2Config,
        GPT2LMHeadModel,
    )

    d = tmp_path_factory.mktemp("kinds")
    tok = BertTokenizerFast(vocab_file=str(CAHP / "vocab.txt"), do_lower_case=True)
    bert = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=64, max_position_embeddings=64, num_labels=5)
    torch.manual_seed(0)
    BertForSequenceClassification(bert).save_pretrained(d / "bert-cls")
    BertModel(bert).save_pretrained(d / "bert-enc")
    GPT2LMHeadModel(GPT2Config(vocab_size=tok.vocab_size, n_embd=32, n_layer=2, n_head=4,
                               n_positions=64)).save_pretrained(d / "gpt2")
    for name in ("bert-cls", "bert-enc", "gpt2"):
        tok.save_pretrained(d / name)
    return {"bert-cls": d / "bert-cls", "bert-enc": d / "bert-enc", "gpt2": d / "gpt2"}


def test_classifier_and_causal_mismatches_are_named(tiny_dirs):
    with pytest.raises(ValueError, match=names(tiny_dirs["gpt2"], "GPT2LMHeadModel", "causal", "classifier")):
        load_model(tiny_dirs["gpt2"], "classifier", num_labels=5)
    with pytest.raises(ValueError, match=names(tiny_dirs["bert-cls"], "BertForSequenceClassification", "classifier", "causal")):
        load_model(tiny_dirs["bert-cls"])
    with pytest.raises(ValueError, match=names(tiny_dirs["bert-enc"], "BertModel", "encoder", "causal")):
        load_model(tiny_dirs["bert-enc"], as_headbudget=True)
    with pytest.raises(ValueError, match=names("classifier", "num_labels")):
        load_model(tiny_dirs["bert-cls"], "classifier")
    # an encoder gets a fresh, seeded head; a classifier keeps its own
    a = load_model(tiny_dirs["bert-enc"], "classifier", num_labels=3, seed=1)
    b = load_model(tiny_dirs["bert-enc"], "classifier", num_labels=3, seed=1)
    assert torch.equal(a.classifier.weight, b.classifier.weight) and a.config.num_labels == 3
    assert type(load_model(tiny_dirs["gpt2"], as_headbudget=True)).__name__ == "HeadBudgetForCausalLM"


def test_a_classifier_of_another_label_count_is_refused_before_its_weights_load(tiny_dirs, monkeypatch):
    import transformers

    def weights(*args, **kwargs):
        raise AssertionError("the weights were loaded before the label count was checked")

    monkeypatch.setattr(transformers.AutoModelForSequenceClassification, "from_pretrained", weights)
    with pytest.raises(ValueError, match=names(tiny_dirs["bert-cls"], "5-label", "3 labels")):
        load_model(tiny_dirs["bert-cls"], "classifier", num_labels=3)


def test_a_config_json_with_a_bom_is_invalid_json_naming_its_line(tmp_path):
    (tmp_path / "config.json").write_bytes(b'\xef\xbb\xbf{"model_type": "gpt2"}')
    with pytest.raises(ValueError, match=names(f"{tmp_path / 'config.json'}:1", "invalid JSON", "BOM")):
        load_model(tmp_path)


def test_bad_kind_and_missing_model_are_refused_before_transformers_is_imported(tmp_path):
    import subprocess
    import sys

    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')  # a model folder: only the kind is wrong
    code = ("import sys\nfrom headbudget.loading import load_model\n"
            "for args in ((sys.argv[1], 'bogus'), (sys.argv[1] + '/none',)):\n"
            "    try:\n        load_model(*args)\n    except (ValueError, FileNotFoundError):\n        pass\n"
            "print('transformers' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "False", run.stderr


@pytest.mark.parametrize(("model", "task", "parts"), [
    ("gpt2", ["--task", "sst5", "--data-dir", str(CAHP / "sst5")], ["GPT2LMHeadModel", "causal", "classifier"]),
    ("bert-cls", ["--task", "lm", "--data", str(Path(__file__).parent / "fixtures" / "lm" / "tiny_corpus.txt")],
     ["BertForSequenceClassification", "classifier", "causal"]),
])
def test_prune_refuses_the_wrong_kind_in_one_line(tiny_dirs, tmp_path, capsys, model, task, parts):
    """No random classification head is bolted onto a decoder, and no classifier is scored as an LM."""
    from headbudget.cli.main import main

    out = tmp_path / "o"
    rc = main(["prune", str(tiny_dirs[model]), *task, "--keep", "4", "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("headbudget prune: error:")]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert_names(lines[0], tiny_dirs[model], *parts)
    assert not out.exists()  # nothing half-written


def test_cost_of_a_gpt2_equals_its_headbudget_conversion(tiny_dirs):
    """Module-counted FLOPs/parameters of an HF GPT-2 equal headbudget.accounting's for its conversion."""
    from transformers import GPT2LMHeadModel

    from headbudget.evaluation.cost import model_cost, module_flops_per_token

    hf = GPT2LMHeadModel.from_pretrained(tiny_dirs["gpt2"])
    hb = load_model(tiny_dirs["gpt2"], as_headbudget=True)
    cost = model_cost(hb)
    assert cost["context"] == 64
    assert cost["flops_per_token"] == module_flops_per_token(hf, 64)
    assert cost["params"] == sum(p.numel() for p in hf.parameters())


# --------------------------------------------------------------------------- several models in one folder
def _tiny_gpt2(d: Path) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=16)).save_pretrained(d)
    return d


def test_folder_with_a_gguf_and_a_safetensors_model_lists_both_and_refuses(tmp_path):
    _tiny_gpt2(tmp_path)
    (tmp_path / "tiny.gguf").write_bytes(b"GGUF")  # never opened: resolving refuses first
    with pytest.raises(ValueError) as err:
        resolve_model(tmp_path)
    assert_names(str(err.value), tmp_path, "2", "config.json", "tiny.gguf", "gguf_file=NAME", "--gguf-file")
    assert resolve_model(tmp_path, gguf_file="tiny.gguf") == ModelSource(tmp_path, "tiny.gguf")
    assert resolve_model(tmp_path / "config.json") == ModelSource(tmp_path)
    # a config.json without weights next to one .gguf is that GGUF's description, not a second model
    (tmp_path / "model.safetensors").unlink()
    assert resolve_model(tmp_path) == ModelSource(tmp_path, "tiny.gguf")


def test_folder_with_several_model_subfolders_lists_them_and_refuses(tmp_path):
    _tiny_gpt2(tmp_path / "a" / "run1")
    _tiny_gpt2(tmp_path / "b")
    (tmp_path / "b" / "1_Pooling").mkdir()  # a model's own subfolder, not another model
    (tmp_path / "b" / "1_Pooling" / "config.json").write_text('{"word_embedding_dimension": 16}')
    with pytest.raises(ValueError, match=names(tmp_path, "2", "b/", "a/run1/")):
        load_model(tmp_path)
    assert resolve_model(tmp_path / "b") == ModelSource(tmp_path / "b")
    shutil.rmtree(tmp_path / "a")
    assert resolve_model(tmp_path) == ModelSource(tmp_path / "b")  # the pooling config is no second model
