"""N-gram extraction at a fixed attention budget: many narrow heads or few wide ones?

Random tokens; at every position t the targets are the tokens at ``t - o`` for each of the k ``offsets``.
One causal attention layer (learned token and position embeddings, residual, linear read-out to k x vocab
logits) with a fixed ``n_heads x head_dim = budget``, swept over the divisors of ``budget``.  Error = 1 -
accuracy on a held-out batch, averaged over seeds.  Prediction: one head attends to one relative position
cleanly, so the error falls steeply until ``n_heads >= k`` and rises again once heads are too narrow.
See docs/allocation.md.

    >>> from headbudget.experiments.ngram import NgramConfig, run_ngram
    >>> r = run_ngram(NgramConfig(budget=8, head_counts=(1, 2), offsets=(1, 2), vocab=4, seq_len=8,
    ...               d_model=8, steps=3, batch=4, seeds=(0,)), progress=False)
    >>> sorted(r["results"])
    ['1', '2']
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from headbudget.experiments._common import recorded_config, write_result
from headbudget.io import new_figure, save_figure
from headbudget.progress import ProgressBar
from headbudget.threads import torch_threads
from headbudget.train.loop import TrainLoop
from headbudget.typed_config import option


@dataclass
class NgramConfig:
    """Sizes of the n-gram experiment (defaults: a few minutes on 2 shared CPU cores)."""

    # each field declares its `headbudget experiment ngram` flag (headbudget.typed_config.option)
    budget: int = option(64, help="n_heads x head_dim")
    head_counts: tuple[int, ...] | None = option(
        None, help="comma list of head counts, each dividing --budget (default: all divisors)", flag="--heads")
    offsets: tuple[int, ...] = option((1, 2, 3, 4), help="comma list of offsets to copy")
    vocab: int = option(16, help="vocabulary size")
    seq_len: int = option(32, help="sequence length")
    d_model: int = option(64, help="embedding width")
    steps: int = option(600, help="training steps per model")
    batch: int = option(64, help="sequences per step")
    lr: float = option(3e-3, help="peak learning rate")
    eval_batch: int = option(512, help="sequences the error is measured on")
    seeds: tuple[int, ...] = option((0, 1), help="comma list of seeds")
    threads: int = option(1, help="torch threads while running", cli=False)  # the CLI's --threads sets it
    # where and how the command reports (_common.RUN_SETTINGS: not recorded in the result)
    out: str = option("results/ngram", help="output folder (ngram.json, .png)")
    progress: bool = option(True, flag="--no-progress", help="no progress bars")

    @classmethod
    def quick(cls) -> NgramConfig:
        """A ~30 second version for smoke runs (``--quick``)."""
        return cls(head_counts=(1, 2, 4, 16, 64), steps=250, eval_batch=256, seeds=(0,))

    def splits(self) -> list[int]:
        counts = list(self.head_counts) if self.head_counts else [h for h in range(1, self.budget + 1)
                                                                     if self.budget % h == 0]
        for h in counts:
            if h <= 0 or self.budget % h:
                raise ValueError(f"ngram: --heads value {h} does not divide --budget {self.budget}")
        return counts


class OneLayerAttention(torch.nn.Module):
    """Embeddings -> causal multi-head attention (n_heads x head_dim) + residual -> linear read-out."""

    def __init__(self, cfg: NgramConfig, n_heads: int, generator: torch.Generator):
        super().__init__()
        d, D = cfg.d_model, cfg.budget
        self.n_heads, self.head_dim = n_heads, D // n_heads

        def p(*shape: int, std: float) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.randn(*shape, generator=generator) * std)

        self.tok, self.pos = p(cfg.vocab, d, std=1.0), p(cfg.seq_len, d, std=1.0)
        self.wq, self.wk, self.wv = (p(D, d, std=1 / math.sqrt(d)) for _ in range(3))
        self.wo = p(d, D, std=1 / math.sqrt(D))
        self.readout = p(len(cfg.offsets) * cfg.vocab, d, std=1 / math.sqrt(d))
        self.k, self.vocab = len(cfg.offsets), cfg.vocab

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        B, T = tokens.shape
        x = self.tok[tokens] + self.pos[:T]
        H, hd = self.n_heads, self.head_dim

        def split(w: torch.Tensor) -> torch.Tensor:
            return (x @ w.T).view(B, T, H, hd).transpose(1, 2)

        q, k, v = split(self.wq), split(self.wk), split(self.wv)
        scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
        mask = torch.ones(T, T, dtype=torch.bool).triu(1)
        att = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, H * hd) @ self.wo.T
        return ((x + y) @ self.readout.T).view(B, T, self.k, self.vocab)


def _batch(cfg: NgramConfig, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(cfg.vocab, (n, cfg.seq_len), generator=g)
    start = max(cfg.offsets)
    # targets: (n, T - start, k)
    return tokens, torch.stack([tokens[:, start - o: cfg.seq_len - o] for o in cfg.offsets], dim=-1)


def _train_eval(cfg: NgramConfig, n_heads: int, seed: int) -> dict[str, float]:
    model = OneLayerAttention(cfg, n_heads, torch.Generator().manual_seed(seed * 1009 + n_heads))
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=max(1, cfg.steps),
                                                pct_start=0.1)
    start = max(cfg.offsets)
    gd = torch.Generator().manual_seed(seed * 7 + 1)

    def loss_fn(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        tokens, targets = batch
        logits = model(tokens)[:, start:]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab), targets.reshape(-1))

    batches = (_batch(cfg, cfg.batch, gd) for _ in range(cfg.steps))
    TrainLoop(model, opt, loss_fn, lr_schedule=sched, nonfinite="ignore").run(batches, steps=cfg.steps)
    tokens, targets = _batch(cfg, cfg.eval_batch, torch.Generator().manual_seed(10_000 + seed))
    with torch.no_grad():
        logits = model(tokens)[:, start:]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab), targets.reshape(-1))
        correct = (logits.argmax(-1) == targets).float()
    return {"error": float(1 - correct.mean()), "loss": float(loss),
            "error_per_offset": [float(1 - c) for c in correct.mean(dim=(0, 1))]}


def run_ngram(cfg: NgramConfig, progress: bool | None = None) -> dict[str, Any]:
    """Run the sweep; returns a JSON-ready dict (config, per-split results, summary with a verdict).
    ``progress``: progress bar (default ``cfg.progress``)."""
    progress = cfg.progress if progress is None else progress
    jobs = [(h, s) for h in cfg.splits() for s in cfg.seeds]
    if min(cfg.offsets) <= 0 or max(cfg.offsets) >= cfg.seq_len:
        raise ValueError(f"ngram: --offsets must be in [1, {cfg.seq_len - 1}], got {list(cfg.offsets)}")
    t0 = time.perf_counter()
    results: dict[str, Any] = {}
    with torch_threads(cfg.threads):
        bar = ProgressBar(jobs, desc="ngram", disable=not progress, unit="model")
        for h, seed in bar:
            bar.set_postfix(heads=h, head_dim=cfg.budget // h, seed=seed)
            entry = results.setdefault(str(h), {"n_heads": h, "head_dim": cfg.budget // h, "runs": []})
            entry["runs"].append(dict(_train_eval(cfg, h, seed), seed=seed))
    for entry in results.values():
        errs = [r["error"] for r in entry["runs"]]
        entry.update(error_mean=sum(errs) / len(errs), error_min=min(errs), error_max=max(errs))
    return {"experiment": "ngram", "config": recorded_config(cfg), "results": results,
            "summary": _summarise(cfg, results), "elapsed_s": round(time.perf_counter() - t0, 1)}


def _summarise(cfg: NgramConfig, results: dict[str, Any]) -> dict[str, Any]:
    k = len(cfg.offsets)
    heads = sorted(int(h) for h in results)
    err = {h: results[str(h)]["error_mean"] for h in heads}
    best = min(heads, key=lambda h: (err[h], h))
    below = [err[h] for h in heads if h < k]
    at_or_above = [err[h] for h in heads if h >= k]
    knee = bool(below) and bool(at_or_above) and min(at_or_above) < min(below) - 0.05
    rises = bool(at_or_above) and err[heads[-1]] > err[best] + 0.05
    if knee and best >= k:
        verdict = (f"agrees: error drops once n_heads >= {k} (the number of offsets); best split "
                   f"{best} x {cfg.budget // best}" + (", and rises again for the narrowest heads" if rises else ""))
    elif best < k:
        verdict = (f"disagrees: the best split has {best} heads, fewer than the {k} offsets to copy")
    else:
        verdict = f"inconclusive: no clear drop at n_heads = {k} (best split {best} x {cfg.budget // best})"
    return {"n_offsets": k, "best_n_heads": best, "error_by_heads": {str(h): err[h] for h in heads},
            "drop_at_n_offsets": knee, "rises_for_narrowest": rises, "verdict": verdict}


def plot_ngram(result: dict[str, Any], path: str) -> None:
    """Error vs number of heads at fixed budget (mean over seeds, min-max band)."""
    fig, ax = new_figure(figsize=(6.4, 4.4))
    heads = sorted(int(h) for h in result["results"])
    mean, lo, hi = ([result["results"][str(h)][k] for h in heads]
                    for k in ("error_mean", "error_min", "error_max"))
    ax.plot(heads, mean, marker="o", label="error (mean over seeds)")
    ax.fill_between(heads, lo, hi, alpha=0.25, label="min-max over seeds")
    k = result["summary"]["n_offsets"]
    ax.axvline(k, color="grey", ls="--", label=f"n_heads = #offsets = {k}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(heads)
    c = result["config"]
    ax.set_xticklabels([f"{h}\nx{c['budget'] // h}" for h in heads])
    ax.set_xlabel("number of heads (x head dim) at fixed budget")
    ax.set_ylabel("error (1 - accuracy)")
    ax.set_title(f"N-gram extraction, offsets {c['offsets']}, budget {c['budget']}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def format_ngram(result: dict[str, Any]) -> str:
    lines = ["n_heads x head_dim   error(mean)  min     max     per-offset error (seed 0)"]
    for h in sorted(result["results"], key=int):
        e = result["results"][h]
        per = " ".join(f"{x:.3f}" for x in e["runs"][0]["error_per_offset"])
        lines.append(f"{e['n_heads']:>7} x {e['head_dim']:<8}  {e['error_mean']:.4f}       "
                     f"{e['error_min']:.4f}  {e['error_max']:.4f}  {per}")
    lines += [f"verdict: {result['summary']['verdict']}", f"elapsed: {result['elapsed_s']} s"]
    return "\n".join(lines)


def write_ngram(result: dict[str, Any], out_dir: str) -> tuple[str, str]:
    """Write ``ngram.json`` and ``ngram.png`` into ``out_dir``; returns their paths."""
    return write_result(result, out_dir, "ngram", plot_ngram)
