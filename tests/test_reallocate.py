"""Prune -> reallocate -> retrain: ``from:DIR`` schedule specs and ``train --init``."""

import json

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import assert_names, error_line, names
from headbudget.cli.main import main
from headbudget.models import HeadBudgetConfig, HeadBudgetForCausalLM, to_headbudget
from headbudget.schedule_spec import schedule_from_spec
from headbudget.schedules import ScheduleError


@pytest.fixture
def pruned_dir(tmp_path):
    m = HeadBudgetForCausalLM(HeadBudgetConfig.from_preset("cpu-tiny", "prism", vocab_size=64))
    dense = m.num_parameters()
    m.prune_heads({1: [0], 2: [1, 2], 3: [3]})
    m.save_pretrained(tmp_path / "pruned")
    return tmp_path / "pruned", dense


def test_from_dir_keeps_the_pruned_profile_and_neutral_rewidens_to_dense_parameters(pruned_dir, capsys):
    path, dense_params = pruned_dir
    kept = schedule_from_spec(f"from:{path}", "cpu-tiny")
    assert kept.heads == (1, 1, 2, 3) and kept.head_dims == (128, 64, 32, 32)
    neutral = schedule_from_spec(f"from:{path}:neutral", "cpu-tiny")
    assert neutral.heads == kept.heads
    assert neutral.budget == 4 * 128  # the dense model's attention budget (layers x d_model)
    rewidened = HeadBudgetForCausalLM(HeadBudgetConfig.from_preset("cpu-tiny", neutral, vocab_size=64))
    assert rewidened.num_parameters() == dense_params
    assert main(["schedule", "--preset", "cpu-tiny", "--kind", f"from:{path}", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [layer["n_heads"] for layer in data["layers"]] == [1, 1, 2, 3]


def test_from_dir_errors_name_the_folder(tmp_path, pruned_dir, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)).save_pretrained(tmp_path / "g")
    capsys.readouterr()  # drop transformers' progress output
    with pytest.raises(ScheduleError, match=names(tmp_path / "g" / "config.json", "'gpt2'")):
        schedule_from_spec(f"from:{tmp_path / 'g'}", "cpu-tiny")
    assert main(["schedule", "--preset", "cpu-tiny", "--kind", f"from:{tmp_path / 'nothing'}"]) == 2
    assert_names(error_line(capsys.readouterr().err, "schedule"), tmp_path / "nothing", "config.json")
    assert main(["schedule", "--preset", "cpu-small", "--kind", f"from:{pruned_dir[0]}"]) == 2
    assert_names(error_line(capsys.readouterr().err, "schedule"), pruned_dir[0], "cpu-small", 6)


def _config(tmp_path, **train):
    t = {"steps": 3, "batch_size": 4, "context": 32, "eval_every": 3, "eval_batches": 1, "log_every": 1,
         "ckpt_every": 0, "warmup_steps": 1, "lr": 3e-3, "progress": False, "threads": 1}
    t.update(train)
    cfg = {"name": "t", "model": {"preset": "cpu-tiny", "schedule": "prism", "n_layers": 3, "d_model": 64,
                                  "n_heads": 4, "prism_max_head_dim": 32, "prism_min_head_dim": 16},
           "data": {"source": "synthetic:20000", "tokenizer": "byte", "cache_dir": str(tmp_path / "cache")},
           "train": t}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_train_init_continues_a_pruned_checkpoint_with_its_schedule_and_tokenizer(tmp_path):
    cfg = _config(tmp_path)
    assert main(["train", cfg, "--out", str(tmp_path / "dense")]) == 0
    dense = AutoModelForCausalLM.from_pretrained(tmp_path / "dense" / "model")
    dense.prune_heads({0: [1], 2: [0, 3]})
    pruned = tmp_path / "pruned"
    dense.save_pretrained(pruned)
    AutoTokenizer.from_pretrained(tmp_path / "dense" / "model").save_pretrained(pruned)
    x = torch.randint(0, 200, (1, 16))

    # lr 0: the run starts from exactly the pruned weights and leaves them unchanged
    assert main(["train", cfg, "--out", str(tmp_path / "frozen"), "--init", str(pruned), "--set", "train.lr=0"]) == 0
    frozen = AutoModelForCausalLM.from_pretrained(tmp_path / "frozen" / "model").eval()
    assert frozen.head_counts == dense.head_counts == [1, 4, 2]
    assert torch.equal(frozen(x).logits, dense.eval()(x).logits)
    summary = json.loads((tmp_path / "frozen" / "summary.json").read_text())
    assert summary["init"] == str(pruned) and summary["schedule_spec"] == f"init:{pruned}"

    assert main(["train", cfg, "--out", str(tmp_path / "retrained"), "--init", str(pruned)]) == 0
    retrained = AutoModelForCausalLM.from_pretrained(tmp_path / "retrained" / "model").eval()
    assert retrained.head_counts == [1, 4, 2]
    assert not torch.equal(retrained(x).logits, frozen(x).logits)


def test_train_init_from_a_llama_gqa_model_and_bad_inputs(tmp_path, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                                         max_position_embeddings=64))
    hb = to_headbudget(llama)
    hb.prune_heads({0: [0]})  # groups of 1 and 2
    hb.save_pretrained(tmp_path / "llama")
    cfg = _config(tmp_path)
    capsys.readouterr()  # transformers' own "Writing model shards" bar of the save above is not the command's
    # no tokenizer saved with it: one line naming the folder
    assert main(["train", cfg, "--out", str(tmp_path / "r0"), "--init", str(tmp_path / "llama")]) == 2
    assert_names(error_line(capsys.readouterr().err, "train"), tmp_path / "llama", "data.tokenizer")
    # with an explicit byte tokenizer (257 tokens <= 300) it trains, keeping the unequal groups
    assert main(["train", cfg, "--out", str(tmp_path / "r1"), "--init", str(tmp_path / "llama"),
                 "--set", "data.tokenizer=byte"]) == 0
    out = AutoModelForCausalLM.from_pretrained(tmp_path / "r1" / "model")
    assert out.transformer.h[0].attn.kv_groups == [1, 2] and out.config.family == "llama"
    small = HeadBudgetForCausalLM(HeadBudgetConfig.from_preset("cpu-tiny", "uniform", vocab_size=100, n_positions=64))
    small.save_pretrained(tmp_path / "small")
    capsys.readouterr()  # the loads and saves above print their own bars
    assert main(["train", cfg, "--out", str(tmp_path / "r2"), "--init", str(tmp_path / "small"),
                 "--set", "data.tokenizer=byte"]) == 2
    assert_names(error_line(capsys.readouterr().err, "train"), tmp_path / "small", 257, 100)
