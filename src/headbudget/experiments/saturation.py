"""Head-dimension saturation: how much does a wider head help, as the sequence gets longer?

A fixed single-head *teacher* attention layer (head dim ``teacher_dim``, bidirectional, on i.i.d. Gaussian
inputs) is imitated by single-head *students* of query/key width ``d`` (value path as wide as the teacher's,
so only the attention pattern is bottlenecked), trained on fresh inputs each step (best of ``lrs``) and scored
on a held-out batch by the **normalised error**
``sum ||y_student - y_teacher||^2 / sum ||y_teacher - mean_over_positions(y_teacher)||^2`` (1.0: uniform
attention, 0: exact).  Prediction: the gain from a wider head flattens sooner, and is smaller, for longer
sequences (the softmax averages over more keys).  See docs/allocation.md.

    >>> from headbudget.experiments.saturation import SaturationConfig, run_saturation
    >>> res = run_saturation(SaturationConfig(seq_lens=(8,), student_dims=(1, 4), d_model=8,
    ...                      teacher_dim=4, steps=5, lrs=(0.1,), tokens_per_step=64, eval_tokens=64),
    ...                      progress=False)
    >>> sorted(res["results"]["8"])
    ['1', '4']
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
class SaturationConfig:
    """Sizes of the saturation experiment (defaults: about 5-8 minutes on 2 shared CPU cores)."""

    # each field declares its `headbudget experiment saturation` flag (headbudget.typed_config.option)
    seq_lens: tuple[int, ...] = option((16, 64, 256, 1024), help="comma list of sequence lengths L")
    student_dims: tuple[int, ...] = option((1, 2, 4, 8, 16, 32, 64), help="comma list of student head dims",
                                           flag="--dims")
    d_model: int = option(64, help="input width")
    teacher_dim: int = option(64, help="teacher head dim")
    logit_scale: float = option(2.0, help="teacher logit std (teacher logits are scaled to std ~ this)")
    steps: int = option(200, help="training steps per student and learning rate")
    lrs: tuple[float, ...] = option((0.03, 0.1), help="comma list of learning rates; each student is trained at "
                                                      "each and the best is kept")
    tokens_per_step: int = option(2048, help="tokens per training batch (batch = max(2, this // L) sequences)")
    eval_tokens: int = option(8192, help="tokens the error is measured on")
    seed: int = option(0, help="seed of the teacher, data and students")
    student_value_dim: int | None = option(None, help="student value width (default: the teacher's)")
    threads: int = option(1, help="torch threads while running", cli=False)  # the CLI's --threads sets it
    # where and how the command reports (_common.RUN_SETTINGS: not recorded in the result)
    out: str = option("results/saturation", help="output folder (saturation.json, .png)")
    progress: bool = option(True, flag="--no-progress", help="no progress bars")
    extra: dict[str, Any] = option(help="free-form notes recorded with the result", cli=False, default_factory=dict)

    @classmethod
    def quick(cls) -> SaturationConfig:
        """A 20-60 second version for smoke runs (``--quick``)."""
        return cls(seq_lens=(16, 64, 256), student_dims=(1, 4, 16, 64), steps=100, lrs=(0.03, 0.1),
                   tokens_per_step=1024, eval_tokens=4096)


class SingleHead(torch.nn.Module):
    """Bidirectional single-head attention ``softmax(q k^T * scale) v`` with q/k width ``qk_dim``."""

    def __init__(self, d_model: int, qk_dim: int, v_dim: int, scale: float, generator: torch.Generator):
        super().__init__()
        self.wq = torch.nn.Parameter(torch.randn(qk_dim, d_model, generator=generator) / math.sqrt(d_model))
        self.wk = torch.nn.Parameter(torch.randn(qk_dim, d_model, generator=generator) / math.sqrt(d_model))
        self.wv = torch.nn.Parameter(torch.randn(v_dim, d_model, generator=generator) / math.sqrt(d_model))
        self.scale = scale

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.wq.T) @ (x @ self.wk.T).transpose(-1, -2) * self.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.logits(x), dim=-1) @ (x @ self.wv.T)


def _train_student(cfg: SaturationConfig, teacher: SingleHead, L: int, d: int, v_dim: int, lr: float
                   ) -> SingleHead:
    """Adam + cosine decay on fresh Gaussian inputs each step; loss is the normalised error."""
    # the student keeps the teacher's softmax scale convention: 1/sqrt(teacher head dim)
    student = SingleHead(cfg.d_model, d, v_dim, 1.0 / math.sqrt(cfg.teacher_dim),
                         torch.Generator().manual_seed(cfg.seed + 7919 * d + L))
    opt = torch.optim.Adam(student.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, cfg.steps))
    batch = max(2, cfg.tokens_per_step // L)
    gd = torch.Generator().manual_seed(cfg.seed + 31 * L + d)
    inputs = (torch.randn(batch, L, cfg.d_model, generator=gd) for _ in range(cfg.steps))

    def loss_fn(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            y = teacher(x)
        centred = y - y.mean(dim=1, keepdim=True)
        return ((student(x) - y) ** 2).sum() / (centred**2).sum()

    # a diverged learning rate is one of the candidates (its error is NaN and never the best): run on
    TrainLoop(student, opt, loss_fn, lr_schedule=sched, nonfinite="ignore").run(inputs, steps=cfg.steps)
    return student


def _normalised_error(y: torch.Tensor, target: torch.Tensor) -> float:
    centred = target - target.mean(dim=1, keepdim=True)
    return float(((y - target) ** 2).sum() / (centred**2).sum().clamp_min(1e-30))


def _teacher_stats(teacher: SingleHead, x: torch.Tensor) -> dict[str, float]:
    with torch.no_grad():
        logits, L = teacher.logits(x), x.shape[1]
        p = torch.softmax(logits, dim=-1)
        entropy = -(p * torch.log(p.clamp_min(1e-30))).sum(-1).mean()
        return {"logit_std": float(logits.std()), "logit_max_abs": float(logits.abs().max()),
                "logit_row_range_mean": float((logits.amax(-1) - logits.amin(-1)).mean()),
                "attention_entropy_normalised": float(entropy / math.log(L)) if L > 1 else 0.0,
                "attention_max_prob_mean": float(p.amax(-1).mean())}


def _saturation_dim(errors: dict[int, float], share: float = 0.9) -> int:
    """Smallest head dim that achieves ``share`` of the total gain err(min d) - err(max d)."""
    dims = sorted(errors)
    gain = errors[dims[0]] - errors[dims[-1]]
    if gain <= 0:
        return dims[0]
    return next((d for d in dims if errors[dims[0]] - errors[d] >= share * gain), dims[-1])


def run_saturation(cfg: SaturationConfig, progress: bool | None = None) -> dict[str, Any]:
    """Run the experiment; returns a JSON-ready dict (config, per-L results, teacher stats, verdict).
    ``progress``: progress bar (default ``cfg.progress``)."""
    with torch_threads(cfg.threads):
        return _run_saturation(cfg, cfg.progress if progress is None else progress)


def _run_saturation(cfg: SaturationConfig, progress: bool) -> dict[str, Any]:
    if cfg.teacher_dim <= 0 or cfg.d_model <= 0:
        raise ValueError("saturation: --d-model and --teacher-dim must be positive")
    g = torch.Generator().manual_seed(cfg.seed)
    scale = cfg.logit_scale / math.sqrt(cfg.teacher_dim)  # q.k has std ~ sqrt(teacher_dim)
    teacher = SingleHead(cfg.d_model, cfg.teacher_dim, cfg.teacher_dim, scale, g).requires_grad_(False)
    v_dim = cfg.student_value_dim or cfg.teacher_dim
    results: dict[str, dict[str, Any]] = {}
    stats: dict[str, dict[str, float]] = {}
    t0 = time.perf_counter()
    jobs = [(L, d) for L in cfg.seq_lens for d in cfg.student_dims]
    bar = ProgressBar(jobs, desc="saturation", disable=not progress, unit="student")
    eval_sets: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for L, d in bar:
        bar.set_postfix(L=L, d=d)
        if L not in eval_sets:
            ge = torch.Generator().manual_seed(cfg.seed + 1000 + L)
            x_eval = torch.randn(max(2, cfg.eval_tokens // L), L, cfg.d_model, generator=ge)
            with torch.no_grad():
                eval_sets[L] = (x_eval, teacher(x_eval))
            stats[str(L)] = _teacher_stats(teacher, x_eval)
        x_eval, y_eval = eval_sets[L]
        best: tuple[float, float, float, float] | None = None
        for lr in cfg.lrs:
            student = _train_student(cfg, teacher, L, d, v_dim, lr)
            with torch.no_grad():
                err = _normalised_error(student(x_eval), y_eval)
                s_logits = student.logits(x_eval)
            if best is None or err < best[0]:
                best = (err, float(s_logits.std()), float(s_logits.abs().max()), lr)
        assert best is not None
        results.setdefault(str(L), {})[str(d)] = dict(zip(
            ("normalised_error", "student_logit_std", "student_logit_max_abs", "best_lr"), best))
    return {"experiment": "saturation", "config": recorded_config(cfg), "teacher_logits": stats,
            "results": results, "summary": _summarise(cfg, results),
            "elapsed_s": round(time.perf_counter() - t0, 1)}


def _summarise(cfg: SaturationConfig, results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    per_L = {}
    for L, by_d in results.items():
        errors = {int(d): r["normalised_error"] for d, r in by_d.items()}
        lo, hi = errors[min(errors)], errors[max(errors)]
        per_L[L] = {"error_at_min_dim": lo, "error_at_max_dim": hi, "gain": lo - hi,
                    "saturation_dim_90pct": _saturation_dim(errors)}
    Ls = sorted(per_L, key=int)
    gains = [per_L[L]["gain"] for L in Ls]
    sat = [per_L[L]["saturation_dim_90pct"] for L in Ls]
    gain_falls = all(a >= b - 1e-3 for a, b in zip(gains, gains[1:]))
    sat_falls = all(a >= b for a, b in zip(sat, sat[1:]))
    sat_strict = sat_falls and sat[-1] < sat[0]
    ratio = gains[-1] / gains[0] if gains and gains[0] > 0 else float("nan")
    agree = gain_falls and ratio < 0.95
    if len(Ls) < 2:
        verdict = "needs at least two sequence lengths to test the prediction"
    else:
        parts = []
        if agree:
            parts.append(f"the gain from d={min(cfg.student_dims)} to d={max(cfg.student_dims)} falls "
                         f"monotonically with L ({gains[0]:.3f} at L={Ls[0]} -> {gains[-1]:.3f} at L={Ls[-1]}, "
                         f"{100 * (1 - ratio):.0f}% smaller)")
        else:
            parts.append(f"the gain does not fall clearly with L ({', '.join(f'{g:.3f}' for g in gains)})")
        if sat_strict:
            parts.append(f"the curves saturate sooner for longer L (90%-of-gain head dim {sat[0]} -> {sat[-1]})")
        elif len(set(sat)) == 1:
            parts.append(f"but the saturation head dim is the same ({sat[0]}) for every L: earlier flattening "
                         "is not observed")
        else:
            parts.append(f"the saturation head dim does not fall with L ({sat})")
        label = ("disagrees", "partly agrees", "agrees")[agree + sat_strict]  # how many of the two hold
        verdict = f"{label}: " + "; ".join(parts)
    return {"per_L": per_L, "gain_decreases_with_L": gain_falls, "gain_ratio_last_first": ratio,
            "saturation_dim_non_increasing_with_L": sat_falls, "verdict": verdict}


def plot_saturation(result: dict[str, Any], path: str) -> None:
    """Normalised error vs student head dim, one line per L (log2 x axis)."""
    fig, ax = new_figure(figsize=(6.4, 4.4))
    for L in sorted(result["results"], key=int):
        by_d = result["results"][L]
        dims = sorted(by_d, key=int)
        std = result["teacher_logits"][L]["logit_std"]
        ax.plot([int(d) for d in dims], [by_d[d]["normalised_error"] for d in dims], marker="o",
                label=f"L={L} (teacher logit std {std:.2f})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("student head dim (q/k width)")
    ax.set_ylabel("normalised error (1 = uniform attention)")
    c = result["config"]
    ax.set_title(f"Head-dim saturation: teacher head dim {c['teacher_dim']}, d_model {c['d_model']}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def format_saturation(result: dict[str, Any]) -> str:
    """Human-readable table of what was measured and the verdict."""
    dims = sorted({int(d) for by_d in result["results"].values() for d in by_d})
    lines = ["L      logit_std  entropy/logL  " + "  ".join(f"d={d:<4d}" for d in dims) + "  sat_dim"]
    for L in sorted(result["results"], key=int):
        by_d = result["results"][L]
        st = result["teacher_logits"][L]
        errs = "  ".join(f"{by_d[str(d)]['normalised_error']:.4f}" if str(d) in by_d else "   -  " for d in dims)
        lines.append(f"{L:<6} {st['logit_std']:9.3f}  {st['attention_entropy_normalised']:12.3f}  {errs}  "
                     f"{result['summary']['per_L'][L]['saturation_dim_90pct']}")
    lines += [f"verdict: {result['summary']['verdict']}", f"elapsed: {result['elapsed_s']} s"]
    return "\n".join(lines)


def write_saturation(result: dict[str, Any], out_dir: str) -> tuple[str, str]:
    """Write ``saturation.json`` and ``saturation.png`` into ``out_dir``; returns their paths."""
    return write_result(result, out_dir, "saturation", plot_saturation)
