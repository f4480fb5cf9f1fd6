"""CAHP and the baselines end to end on tiny random BERT / GPT-2 classifiers (fixture data)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import assert_names, error_line, names

FIX = Path(__file__).resolve().parent / "fixtures" / "cahp"


def load_classifier(path, num_labels):
    from headbudget.loading import load_model

    return load_model(path, "classifier", num_labels=num_labels)
DATA = FIX / "sst5"


def _tokenizer():
    from transformers import BertTokenizerFast

    return BertTokenizerFast(vocab_file=str(FIX / "vocab.txt"), do_lower_case=True)


def _save_tiny(tmp: Path, family: str) -> Path:
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        GPT2Config,
        GPT2ForSequenceClassification,
    )

    tok = _tokenizer()
    torch.manual_seed(0)
    if family == "bert":
        cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64, max_position_embeddings=64, num_labels=5)
        model = BertForSequenceClassification(cfg)
    else:
        cfg = GPT2Config(vocab_size=tok.vocab_size, n_embd=32, n_layer=2, n_head=4, n_positions=64, num_labels=5,
                         pad_token_id=tok.pad_token_id)
        model = GPT2ForSequenceClassification(cfg)
    out = tmp / f"tiny-{family}"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    return _save_tiny(tmp_path_factory.mktemp("models"), "bert")


def _job(model, out, **kw):
    """A PruneJob; with ``methods``, a PruneCompareJob."""
    from headbudget.pruning.job import PruneCompareJob, PruneJob

    base = dict(model=str(model), task="sst5", data_dir=str(DATA), out=str(out), pool_size=8, batch_size=16,
                finetune_epochs=0, progress=False, lr=1e-3)
    base.update(kw)
    return (PruneCompareJob if "methods" in kw else PruneJob)(**base)


def test_signatures_from_model_ignore_padding(tiny_bert):
    """A batch padded to a longer length gives the same signature as unpadded inputs."""
    from headbudget.models.surgery import get_adapter
    from headbudget.pruning.cahp import model_signatures

    model = load_classifier(tiny_bert, 5).eval()
    ad = get_adapter(model)
    tok = _tokenizer()
    texts = ["the movie was superb", "awful plot", "a very dull story and plain acting"]
    padded = dict(tok(texts, padding=True, return_tensors="pt"), labels=torch.tensor([4, 0, 1]))
    singles = [dict(tok([t], return_tensors="pt"), labels=torch.tensor([y])) for t, y in zip(texts, [4, 0, 1])]
    a = model_signatures(ad, [padded], 5, grid=8, progress=False)
    b = model_signatures(ad, singles, 5, grid=8, progress=False)
    torch.testing.assert_close(a.mean, b.mean, atol=1e-6, rtol=0)
    torch.testing.assert_close(a.var, b.var, atol=1e-6, rtol=0)
    assert a.count.tolist() == [1.0, 1.0, 0.0, 0.0, 1.0]


def test_prune_cahp_cli_end_to_end(tiny_bert, tmp_path):
    from headbudget.cli.main import main

    out = tmp_path / "cahp"
    rc = main(["prune", str(tiny_bert), "--task", "sst5", "--data-dir", str(DATA), "--method", "cahp",
               "--pool-size", "8", "--batch-size", "16", "--finetune-epochs", "1", "--lr", "1e-3",
               "--no-progress", "--out", str(out)])
    assert rc == 0
    rep = json.loads((out / "report.json").read_text())
    assert list(rep) == ["method", "heads_total", "heads_kept", "kept", "mean_depth", "middle_third_share", "knee_k",
                         "k_source", "mss", "metric", "seconds", "cost"]
    assert rep["method"] == "cahp" and rep["heads_total"] == 8
    # size before/after, from the shapes: a removed BERT head (hidden 32, head dim 8) takes q/k/v rows with
    # biases (3 * (8*32 + 8)) and 8 o_proj columns (8*32) = 1048 parameters, and 2 * 1024 linear FLOPs plus
    # 2 * 64 * (8 + 8) score/value FLOPs at the 64-position context
    removed = 8 - rep["heads_kept"]
    dense_params = sum(p.numel() for p in load_classifier(tiny_bert, 5).parameters())
    assert rep["cost"]["params"] == {"before": dense_params, "after": dense_params - 1048 * removed}
    fl = rep["cost"]["flops_per_token"]
    assert rep["cost"]["context"] == 64 and fl["before"] - fl["after"] == (2048 + 2 * 64 * 16) * removed
    assert "## Size" in (out / "report.md").read_text()
    assert [k for k, _ in rep["mss"]] == list(range(2, 8))
    assert set(rep["metric"]) == {"dense", "pruned", "finetuned"}
    assert all(isinstance(v, float) for v in rep["metric"].values())
    assert set(rep["kept"]) == {"0", "1"} and all(rep["kept"][k] for k in rep["kept"])  # >= 1 head per layer
    assert rep["heads_kept"] == sum(len(v) for v in rep["kept"].values()) < 8
    for name in ("report.md", "details.json", "mss.png", "embedding.png", "heads_per_layer.png",
                 "accuracy_vs_heads.png", "model/kept_heads.json"):
        assert (out / name).exists(), name
    # the saved model is physically pruned and reloads with the kept heads
    model = load_classifier(out / "model", 5)
    from headbudget.models.surgery import get_adapter

    ad = get_adapter(model)
    assert {str(k): v for k, v in ad.original_heads().items()} == rep["kept"]
    assert ad.head_counts() == [len(rep["kept"]["0"]), len(rep["kept"]["1"])]


def test_cahp_forced_keep_and_removed_equals_gated(tiny_bert, tmp_path):
    """--keep gives exactly that many heads and the pruned model's dev accuracy equals the gated dense one."""
    from headbudget.data.classification import load_task
    from headbudget.models.surgery import get_adapter
    from headbudget.pruning.finetune import evaluate_accuracy, predict
    from headbudget.pruning.importance import gate_mask
    from headbudget.pruning.pipeline import run_prune

    res = run_prune(_job(tiny_bert, tmp_path / "k5", keep=5))
    rep = res["report"]
    assert rep["heads_kept"] == 5
    dense = load_classifier(tiny_bert, 5).eval()
    pruned = load_classifier(tmp_path / "k5" / "model", 5).eval()
    ad = get_adapter(dense)
    kept_flat = [layer * 4 + h for layer, hs in rep["kept"].items() for h in hs for layer in [int(layer)]]
    dev = load_task("sst5", DATA).splits["dev"]
    tok = _tokenizer()
    with ad.set_gate_values(gate_mask(kept_flat, [4, 4])):
        gated = predict(dense, tok, dev)
    assert torch.equal(gated, predict(pruned, tok, dev))
    assert rep["metric"]["pruned"] == pytest.approx(evaluate_accuracy(pruned, tok, dev))


@pytest.mark.parametrize("method", ["michel", "fisher", "magnitude", "random"])
def test_baselines_forced_head_count(tiny_bert, tmp_path, method):
    from headbudget.pruning.pipeline import run_prune

    rep = run_prune(_job(tiny_bert, tmp_path / method, method=method, keep=6, save_model=False,
                         limit_train=32))["report"]
    assert rep["heads_kept"] == 6 and rep["knee_k"] is None and rep["mss"] == []
    assert all(len(v) >= 1 for v in rep["kept"].values())


def test_baseline_without_head_count_is_a_one_line_error(tiny_bert, tmp_path, capsys):
    from headbudget.cli.main import main

    rc = main(["prune", str(tiny_bert), "--task", "sst5", "--data-dir", str(DATA), "--method", "fisher",
               "--out", str(tmp_path / "x")])
    assert rc == 2
    assert_names(error_line(capsys.readouterr().err, "prune"), "fisher", "keep", "keep_ratio")
    rc = main(["prune", str(tiny_bert), "--task", "sst5", "--data-dir", str(DATA), "--keep", "9",
               "--out", str(tmp_path / "x")])
    assert rc == 2
    errors = [ln for ln in capsys.readouterr().err.splitlines() if "error:" in ln]  # after the progress bars
    assert len(errors) == 1
    assert_names(error_line(errors[0], "prune"), 9, 8, 2)  # 9 asked, 8 heads in 2 layers


def test_reproducible_with_seed(tiny_bert, tmp_path):
    from headbudget.pruning.pipeline import run_prune

    a = run_prune(_job(tiny_bert, tmp_path / "a", save_model=False, seed=3, limit_train=40))
    b = run_prune(_job(tiny_bert, tmp_path / "b", save_model=False, seed=3, limit_train=40))
    assert a["report"]["kept"] == b["report"]["kept"]
    assert a["report"]["mss"] == b["report"]["mss"]
    np.testing.assert_array_equal(a["details"]["salience"], b["details"]["salience"])
    r1 = run_prune(_job(tiny_bert, tmp_path / "r1", method="random", keep=4, save_model=False, seed=1, limit_train=16))
    r2 = run_prune(_job(tiny_bert, tmp_path / "r2", method="random", keep=4, save_model=False, seed=1, limit_train=16))
    r3 = run_prune(_job(tiny_bert, tmp_path / "r3", method="random", keep=4, save_model=False, seed=2, limit_train=16))
    assert r1["report"]["kept"] == r2["report"]["kept"] != r3["report"]["kept"]


def test_gpt2_decoder_family_pipeline(tmp_path):
    from headbudget.models.surgery import get_adapter
    from headbudget.pruning.pipeline import run_prune

    model_dir = _save_tiny(tmp_path, "gpt2")
    rep = run_prune(_job(model_dir, tmp_path / "g", keep=4, finetune_epochs=1))["report"]
    assert rep["heads_kept"] == 4 and rep["metric"]["finetuned"] is not None
    model = load_classifier(tmp_path / "g" / "model", 5)
    ad = get_adapter(model)
    assert ad.family == "gpt2" and sum(ad.head_counts()) == 4


def test_prune_compare_same_head_count(tiny_bert, tmp_path):
    from headbudget.pruning.compare import parse_methods, run_prune_compare

    assert parse_methods("cahp@2, michel") == [("cahp-d2", "cahp", 2), ("michel", "michel", None)]
    with pytest.raises(ValueError, match=names("'foo'", "cahp", "michel")):
        parse_methods("cahp,foo")
    summary = run_prune_compare(_job(tiny_bert, tmp_path / "cmp", save_model=False, methods="cahp@2,magnitude,random"))
    counts = {r["label"]: r["heads_kept"] for r in summary["rows"]}
    assert len(set(counts.values())) == 1, counts
    assert (tmp_path / "cmp" / "compare.md").read_text().count("\n| ") >= 3
    assert (tmp_path / "cmp" / "heads_per_layer.png").exists()


def test_label_free_lm_mode_on_tiny_gpt2():
    """Label-free CAHP: JS-divergence signatures + LM-loss salience on a tiny causal LM."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from headbudget.models.surgery import get_adapter
    from headbudget.pruning.cahp import cahp_select
    from headbudget.pruning.job import CahpSettings

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=32, n_layer=2, n_head=4, n_positions=32)).eval()
    ad = get_adapter(model)
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(4):
        ids = torch.randint(0, 50, (4, 12), generator=g)
        batches.append({"input_ids": ids, "labels": ids})
    sel, secs = cahp_select(ad, batches, batches, CahpSettings(pool_size=6), n_classes=None, keep=4, seed=0,
                            progress=False)
    assert len(sel.kept) == 4 and set(secs) == {"signatures", "salience", "cluster"}
    assert {sel.heads[i][0] for i in sel.kept} == {0, 1}  # at least one head per layer
    sel2, _ = cahp_select(ad, batches, batches, CahpSettings(pool_size=6), n_classes=None, keep=4, seed=0,
                            progress=False)
    assert sel2.kept == sel.kept


def test_accuracy_curve_knee(tiny_bert, tmp_path):
    from headbudget.pruning.pipeline import run_prune

    res = run_prune(_job(tiny_bert, tmp_path / "acc", curve="accuracy", curve_step=2, save_model=False))
    curve = res["details"]["accuracy_curve"]
    assert [c[0] for c in curve] == [2, 4, 6]
    assert res["details"]["knee_source"] in ("accuracy", "fallback-max-accuracy")
    assert res["report"]["knee_k"] in (2, 4, 6)
    # the curve's point at the chosen k is the accuracy of the gated model == the pruned one
    at_k = {c[0]: c for c in curve}[res["report"]["knee_k"]]
    assert at_k[1] == res["report"]["heads_kept"]
    assert at_k[2] == pytest.approx(res["report"]["metric"]["pruned"])


def test_prune_compare_each_cahp_its_own_knee(tiny_bert, tmp_path):
    """Every cahp@d finds its own knee; a baseline takes the count of the nearest cahp entry before it."""
    from headbudget.pruning.compare import run_prune_compare
    from headbudget.pruning.pipeline import run_prune

    summary = run_prune_compare(_job(tiny_bert, tmp_path / "cmp", save_model=False,
                                     methods="cahp@6,magnitude,cahp@3,random"))  # knees 5 and 4 at seed 42
    rows = {r["label"]: r for r in summary["rows"]}
    assert rows["cahp-d6"]["count_from"] == "cahp-d6 knee"
    assert rows["cahp-d3"]["count_from"] == "cahp-d3 knee"
    assert rows["magnitude"]["count_from"] == "cahp-d6 knee"
    assert rows["random"]["count_from"] == "cahp-d3 knee"
    assert rows["magnitude"]["heads_kept"] == rows["cahp-d6"]["heads_kept"]
    assert rows["random"]["heads_kept"] == rows["cahp-d3"]["heads_kept"]
    # each cahp row is what a standalone run with that degree gives (its own knee, not the other's count)
    for deg in (6, 3):
        alone = run_prune(_job(tiny_bert, tmp_path / f"d{deg}", save_model=False, poly_degree=deg))["report"]
        assert rows[f"cahp-d{deg}"]["heads_kept"] == alone["heads_kept"]
        assert rows[f"cahp-d{deg}"]["knee_k"] == alone["knee_k"]
    assert rows["cahp-d6"]["knee_k"] != rows["cahp-d3"]["knee_k"], rows
    md = (tmp_path / "cmp" / "compare.md").read_text()
    assert "count from" in md and "cahp-d3 knee" in md
    forced = run_prune_compare(_job(tiny_bert, tmp_path / "f", save_model=False, keep=3, methods="cahp@6,cahp@3,random"))
    assert [(r["heads_kept"], r["count_from"]) for r in forced["rows"]] == [(3, "keep=3")] * 3


def test_salience_uses_first_quarter_in_file_order(tiny_bert, tmp_path, monkeypatch):
    """Salience sees the first int(f * n) training sentences in file order (the published code), all of them."""
    import headbudget.pruning.importance as imp
    from headbudget.pruning.pipeline import run_prune

    lines = [ln for ln in (DATA / "train.txt").read_text().splitlines() if ln.strip()]
    file_labels = [int(ln[1]) for ln in lines]  # each tree opens with "(<root label>"
    seen = []
    real = imp.salience

    def spy(adapter, model, batches, loss_fn, fraction=0.25, progress=True):
        seen.append(([int(v) for b in batches for v in b["labels"]], fraction))
        return real(adapter, model, batches, loss_fn, fraction=fraction, progress=progress)

    monkeypatch.setattr(imp, "salience", spy)
    for frac in (0.25, 0.26):  # 15 and 15.6 of 60 -> 15 both (rounded down)
        run_prune(_job(tiny_bert, tmp_path / f"s{frac}", keep=4, save_model=False, salience_fraction=frac))
    assert len(lines) == 60
    assert seen == [(file_labels[:15], 1.0), (file_labels[:15], 1.0)]
    seen.clear()
    run_prune(_job(tiny_bert, tmp_path / "shuf", keep=4, save_model=False, salience_order="shuffled"))
    labels, frac = seen[0]
    assert frac == 0.25 and len(labels) == 60  # the earlier choice: all shuffled batches, salience takes a quarter


def test_label_free_signatures_values_rows_renormalised_before_pooling():
    """Label-free signature = mean over inputs of each head's resized map with every query row renormalised
    (per input, before pooling), recomputed from the model's own attention output."""
    import torch.nn.functional as F
    from transformers import GPT2Config, GPT2LMHeadModel

    from headbudget.models.surgery import get_adapter
    from headbudget.pruning.cahp import model_signatures

    torch.manual_seed(1)
    cfg = GPT2Config(vocab_size=50, n_embd=32, n_layer=2, n_head=4, n_positions=32)
    cfg._attn_implementation = "eager"
    model = GPT2LMHeadModel(cfg).eval()
    g = torch.Generator().manual_seed(3)
    batches = [{"input_ids": torch.randint(0, 50, (3, 11), generator=g)} for _ in range(2)]
    batches.append({"input_ids": torch.randint(0, 50, (2, 5), generator=g)})  # another length: 8 inputs in all
    grid = 4
    per_input = []
    with torch.no_grad():
        for b in batches:
            att = torch.cat(model(b["input_ids"], output_attentions=True).attentions, dim=1)  # (B, 8, T, T)
            r = F.interpolate(att.double(), size=(grid, grid), mode="bilinear", align_corners=False)
            per_input.append(r / r.sum(-1, keepdim=True))
    normed = torch.cat(per_input)  # (8 inputs, 8 heads, grid, grid)
    want = normed.mean(0)
    sig = model_signatures(get_adapter(model), batches, None, grid=grid, progress=False)
    assert sig.label_free and sig.mean.shape == (1, 8, grid, grid) and float(sig.count[0]) == 8
    torch.testing.assert_close(sig.mean[0], want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sig.mean[0].sum(-1), torch.ones(8, grid, dtype=torch.float64), rtol=0, atol=1e-6)
    # renormalising after pooling instead gives other values (so the order is what is tested)
    raw = torch.cat([F.interpolate(torch.cat(model(b["input_ids"], output_attentions=True).attentions, 1).detach()
                                   .double(), size=(grid, grid), mode="bilinear", align_corners=False)
                     for b in batches]).mean(0)
    assert (raw / raw.sum(-1, keepdim=True) - want).abs().max() > 1e-4
    # the JS distance the mode clusters by, from the same pooled rows
    from headbudget.pruning.signatures import js_distance_matrix

    pooled = sig.mean[0] / sig.mean[0].sum(-1, keepdim=True)
    d = js_distance_matrix(sig.mean[0])
    for i, j in ((0, 5), (2, 7)):
        p, q = pooled[i], pooled[j]
        m = 0.5 * (p + q)
        safe = m.clamp(min=1e-300)  # where m == 0 both p and q are 0 and the terms are 0
        js = 0.5 * torch.special.xlogy(p, p / safe).sum(-1) + 0.5 * torch.special.xlogy(q, q / safe).sum(-1)
        assert d[i, j] == pytest.approx(float(js.mean()), rel=1e-6) and d[j, i] == d[i, j] and d[i, j] > 0


def test_prune_compare_resume_reuses_finished_methods(tiny_bert, tmp_path, monkeypatch):
    """``resume``: methods finished with the same settings are read back (not rerun) with identical rows;
    changed settings rerun them."""
    import headbudget.pruning.pipeline as pl
    from headbudget.pruning.compare import run_prune_compare

    job = _job(tiny_bert, tmp_path / "cmp", keep=4, methods="cahp@6,random")
    first = run_prune_compare(job)
    calls = []
    real = pl.run_prune

    def spy(sub, loaded=None, **kw):
        calls.append(sub.method)
        return real(sub, loaded, **kw)

    monkeypatch.setattr(pl, "run_prune", spy)
    seen = []
    again = run_prune_compare(dataclasses.replace(job, methods="cahp@6,random,magnitude"), resume=True, on_row=lambda r: seen.append(r["label"]))
    assert calls == ["magnitude"] and seen == ["cahp-d6", "random", "magnitude"]
    for a, b in zip(first["rows"], again["rows"]):
        assert a == b
    calls.clear()
    run_prune_compare(dataclasses.replace(job, seed=7, methods="cahp@6"), resume=True)
    assert calls == ["cahp"]  # another seed: not the finished run


