"""Checkpoints open anywhere: trained, pruned Llama-GQA and compressed models load
with plain transformers where ``import headbudget`` is impossible, give the same logits, and lm-eval's
``hf`` backend scores them with ``trust_remote_code=True``."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import headbudget.models
from headbudget.compression.svd import svd_compress
from headbudget.loading import load_tokenizer
from headbudget.models import HeadBudgetConfig, HeadBudgetForCausalLM, to_headbudget
from headbudget.train import RunConfig, Trainer

FIXTURES = Path(__file__).parent / "fixtures" / "lm_eval"

# Runs in a fresh interpreter whose import system refuses headbudget, with the repo off sys.path.
NO_HEADBUDGET = r"""
import json, sys, torch
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name == "headbudget" or name.startswith("headbudget."):
            raise ImportError("headbudget is not installed here")
sys.meta_path.insert(0, Refuse())
from transformers import AutoModelForCausalLM, AutoTokenizer
dirs, ids, out = json.loads(sys.argv[1]), torch.tensor(json.loads(sys.argv[2])), sys.argv[3]
logits = {}
for name, d in dirs.items():
    m = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True).eval()
    assert type(m).__module__.startswith("transformers_modules"), type(m).__module__
    AutoTokenizer.from_pretrained(d, trust_remote_code=True)  # the tokenizer sits at the folder root
    with torch.no_grad():
        logits[name] = m(ids).logits
torch.save(logits, out)
if len(sys.argv) > 4:
    import lm_eval
    from lm_eval.tasks import TaskManager
    res = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={dirs['pruned_llama']},trust_remote_code=True",
                                  tasks=["hb_mc"], task_manager=TaskManager(include_path=sys.argv[4]),
                                  batch_size=4, device="cpu", log_samples=True)
    preds = [int(max(range(len(s["filtered_resps"])), key=lambda i: s["filtered_resps"][i][0]))
             for s in res["samples"]["hb_mc"]]
    print("RESULT " + json.dumps({"acc": res["results"]["hb_mc"]["acc,none"], "preds": preds}))
"""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("anywhere")
    tok = load_tokenizer("byte")
    # trained
    cfg = RunConfig.from_dict({
        "name": "t", "model": {"preset": "cpu-tiny", "schedule": "prism", "n_layers": 2, "d_model": 32, "n_heads": 2,
                               "prism_max_head_dim": 16, "prism_min_head_dim": 8},
        "data": {"source": "synthetic:5000", "tokenizer": "byte", "cache_dir": str(root / "cache")},
        "train": {"steps": 2, "batch_size": 2, "context": 16, "eval_every": 2, "eval_batches": 1, "ckpt_every": 0,
                  "progress": False, "threads": 1}})
    trained = Trainer(cfg, root / "run").run().model_dir
    # pruned Llama-GQA (unequal groups)
    torch.manual_seed(0)
    llama = to_headbudget(LlamaForCausalLM(LlamaConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=260, max_position_embeddings=256)))
    llama.prune_heads({0: [0], 1: [1, 3]})
    llama.save_pretrained(root / "pruned_llama")
    tok.save_pretrained(root / "pruned_llama")
    # compressed (low-rank qk and v widths)
    comp = HeadBudgetForCausalLM(HeadBudgetConfig.from_preset("cpu-tiny", "uniform", vocab_size=260, n_positions=64))
    svd_compress(comp, qk_ranks=[16, 12, 8, 8], v_ranks=[24, 16, 8, 4])
    comp.save_pretrained(root / "compressed")
    tok.save_pretrained(root / "compressed")
    return {"trained": str(trained), "pruned_llama": str(root / "pruned_llama"), "compressed": str(root / "compressed")}


def _run_without_headbudget(args, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.run([sys.executable, "-c", NO_HEADBUDGET, *args], capture_output=True, text=True,
                          cwd=FIXTURES, env=env, timeout=600)


def test_saved_code_is_the_package_model_file(checkpoints):
    here = Path(headbudget.models.__file__).parent
    for d in checkpoints.values():
        for name in ("configuration_headbudget.py", "modeling_headbudget.py", "rotary_headbudget.py"):
            assert (Path(d) / name).read_bytes() == (here / name).read_bytes()
        assert json.loads((Path(d) / "config.json").read_text())["auto_map"]["AutoModelForCausalLM"] == \
            "modeling_headbudget.HeadBudgetForCausalLM"


def test_plain_transformers_and_lm_eval_open_them_without_headbudget(checkpoints, tmp_path):
    ids = torch.randint(0, 250, (2, 12))
    proc = _run_without_headbudget([json.dumps(checkpoints), json.dumps(ids.tolist()), str(tmp_path / "l.pt"),
                                    str(FIXTURES)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    remote = torch.load(tmp_path / "l.pt")
    for name, d in checkpoints.items():
        local = AutoModelForCausalLM.from_pretrained(d).eval()  # headbudget imported: no flag needed
        assert isinstance(local, HeadBudgetForCausalLM)
        with torch.no_grad():
            assert (local(ids).logits - remote[name]).abs().max() <= 1e-5, name
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-3000:]
    got = json.loads(lines[0][7:])
    # the same task through lm-eval's hf backend on the package-registered class, in this process
    import lm_eval
    from lm_eval.tasks import TaskManager

    cwd = os.getcwd()
    os.chdir(FIXTURES)
    try:
        res = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={checkpoints['pruned_llama']}",
                                      tasks=["hb_mc"], task_manager=TaskManager(include_path=str(FIXTURES)),
                                      batch_size=4, device="cpu", log_samples=True)
    finally:
        os.chdir(cwd)
    preds = [int(max(range(len(s["filtered_resps"])), key=lambda i: s["filtered_resps"][i][0]))
             for s in res["samples"]["hb_mc"]]
    assert got["preds"] == preds and got["acc"] == res["results"]["hb_mc"]["acc,none"]
    assert len(preds) == sum(1 for _ in open(FIXTURES / "mc.jsonl"))
