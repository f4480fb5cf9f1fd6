"""Every command's output is the next command's input, on tiny models of each family:
train -> prune -> eval / perplexity / attention -> compress -> train --init for GPT-2, Llama-GQA and
headbudget decoders (each output folder also opens where headbudget cannot be imported), and
finetune -> prune -> evaluate for a BERT encoder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from conftest import names
from headbudget.cli.main import main
from headbudget.loading import load_model, load_tokenizer

HERE = Path(__file__).parent
TEXT = HERE / "fixtures" / "lm" / "tiny_corpus.txt"
ZEROSHOT = HERE / "fixtures" / "zeroshot"


def _train_config(tmp_path: Path) -> str:
    cfg = {"name": "chain", "model": {"preset": "cpu-tiny", "schedule": "prism", "n_layers": 2, "d_model": 64,
                                      "n_heads": 4, "prism_max_head_dim": 32, "prism_min_head_dim": 16},
           "data": {"source": str(TEXT), "tokenizer": "byte", "cache_dir": str(tmp_path / "cache")},
           "train": {"steps": 2, "batch_size": 2, "context": 32, "eval_every": 2, "eval_batches": 1,
                     "ckpt_every": 0, "warmup_steps": 1, "progress": False, "threads": 1}}
    path = tmp_path / "chain.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _source(family: str, tmp_path: Path, cfg: str) -> Path:
    if family == "headbudget":
        assert main(["train", cfg, "--out", str(tmp_path / "run")]) == 0
        return tmp_path / "run"  # a run folder: every command accepts it
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if family == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=300, n_positions=128))
    else:
        model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                                             max_position_embeddings=128))
    out = tmp_path / family
    model.save_pretrained(out)
    load_tokenizer("byte").save_pretrained(out)
    return out


@pytest.mark.parametrize("family", ["headbudget", "gpt2", "llama"])
def test_decoder_chain(family, tmp_path, capsys):
    from test_open_anywhere import _run_without_headbudget

    cfg = _train_config(tmp_path)
    src = _source(family, tmp_path, cfg)
    pruned = tmp_path / "pruned"
    assert main(["prune", str(src), "--task", "lm", "--data", str(TEXT), "--method", "magnitude", "--keep-ratio",
                 "0.6", "--context", "32", "--calib-windows", "4", "--out", str(pruned), "--no-progress"]) == 0
    report = json.loads((pruned / "report.json").read_text())
    cost = report["cost"]
    assert cost["params"]["after"] < cost["params"]["before"]  # pruning never makes a model bigger
    assert cost["flops_per_token"]["after"] < cost["flops_per_token"]["before"]
    model = load_model(pruned / "model")
    assert sum(model.head_counts) == report["heads_kept"] and model.num_parameters() == cost["params"]["after"]
    assert not (pruned / "model" / "kept_heads.json").exists()

    capsys.readouterr()
    assert main(["eval", str(pruned / "model"), "--tasks", "piqa", "--data-dir", str(ZEROSHOT), "--limit", "3",
                 "--json", str(tmp_path / "eval.json")]) == 0
    assert "piqa" in json.loads((tmp_path / "eval.json").read_text())["results"]
    assert main(["perplexity", str(pruned / "model"), "--data", str(TEXT), "--context", "32", "--max-windows", "4",
                 "--json", str(tmp_path / "ppl.json"), "--quiet"]) == 0
    assert json.loads((tmp_path / "ppl.json").read_text())["ppl"] > 1
    assert main(["attention", str(pruned / "model"), "--data", str(TEXT), "--out", str(tmp_path / "attn"), "--seq-len", "32",
                 "--n-seqs", "2"]) == 0

    compressed = tmp_path / "compressed"
    assert main(["compress", str(pruned / "model"), "--method", "svd", "--keep-ratio", "0.5", "--data", str(TEXT),
                 "--context", "32", "--max-windows", "2", "--out", str(compressed), "--no-progress"]) == 0
    comp = load_model(compressed / "model")
    assert comp.head_counts == model.head_counts
    assert all(b.attn.v_head_dim < m.attn.v_head_dim for b, m in zip(comp.transformer.h, model.transformer.h))

    assert main(["train", cfg, "--init", str(compressed / "model"), "--out", str(tmp_path / "retrained")]) == 0
    retrained = load_model(tmp_path / "retrained")
    assert retrained.config.layer_specs() == comp.config.layer_specs()

    folders = {"pruned": str(pruned / "model"), "compressed": str(compressed / "model"),
               "retrained": str(tmp_path / "retrained" / "model")}
    ids = torch.randint(0, 250, (1, 10))
    proc = _run_without_headbudget([json.dumps(folders), json.dumps(ids.tolist()), str(tmp_path / "l.pt")], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    remote = torch.load(tmp_path / "l.pt")
    for name, folder in folders.items():
        with torch.no_grad():
            assert (load_model(folder)(ids).logits - remote[name]).abs().max() <= 1e-5, name


def test_encoder_chain_finetune_prune_evaluate(tmp_path):
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    from headbudget.data.classification import load_task
    from headbudget.pruning.finetune import evaluate_accuracy
    from test_prune_cli import DATA, FIX

    tok = BertTokenizerFast(vocab_file=str(FIX / "vocab.txt"))
    torch.manual_seed(0)
    BertForSequenceClassification(BertConfig(vocab_size=tok.vocab_size, hidden_size=16, num_hidden_layers=2,
                                             num_attention_heads=4, intermediate_size=32,
                                             max_position_embeddings=64, num_labels=5)).save_pretrained(tmp_path / "b")
    tok.save_pretrained(tmp_path / "b")
    assert main(["finetune", str(tmp_path / "b"), "--task", "sst5", "--data-dir", str(DATA), "--out",
                 str(tmp_path / "ft"), "--epochs", "1", "--max-steps", "2", "--batch-size", "8", "--no-progress"]) == 0
    assert main(["prune", str(tmp_path / "ft"), "--task", "sst5", "--data-dir", str(DATA), "--method", "magnitude",
                 "--keep", "5", "--finetune-epochs", "0", "--out", str(tmp_path / "p"), "--no-progress"]) == 0
    report = json.loads((tmp_path / "p" / "report.json").read_text())
    model = load_model(tmp_path / "p" / "model", kind="classifier", num_labels=5)
    assert type(model).__name__ == "BertForSequenceClassification"  # encoders keep their HF class
    from headbudget.models.surgery import get_adapter

    assert sum(get_adapter(model).head_counts()) == 5
    tokenizer = load_tokenizer(model_dir=tmp_path / "p" / "model")
    data = load_task("sst5", DATA)
    acc = evaluate_accuracy(model, tokenizer, data.splits[data.eval_splits[0]])
    assert acc == pytest.approx(report["metric"]["pruned"])  # the reopened model scores what the report says
    with pytest.raises(ValueError, match=names(tmp_path / "p" / "model", "classifier", "causal")):  # not a causal LM
        load_model(tmp_path / "p" / "model", kind="causal")
