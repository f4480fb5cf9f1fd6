"""Gate-training baselines: differentiable subset pruning (DSP, pipelined and joint) and PASS (joint and frozen).

Each learns one logit per head on the training batches, the gates applied where every adapter applies them
(the input of the attention output projection, the same as scaling the head's attention probabilities), then
keeps exactly ``k`` heads by logit rank; the adapter removes the rest physically.  ``pipelined-dsp`` /
``joint-dsp`` (Li, Cotterell & Sachan, TACL 2021): the Gumbel soft top-k of the logits at a temperature
annealed 1000 -> 1e-8 over ``cooldown`` steps, the model frozen / trained with the gates; ``pass`` /
``pass-frozen`` (Ding et al.): hard-concrete gates under the almost-sure sparsity penalty, trained with the
weights from the pre-trained model / alone on the frozen one (the published SST-5 trainer's "concentrator" is
switched off there and not implemented here).  Protocols, schedules and the published settings (CAHP's
``benchmark/`` folder, SST-5, the defaults here): docs/pruning.md, "Published baselines".

The training relaxations are global, so a layer may be switched off during gate training; the
one-head-per-layer rule (:func:`headbudget.pruning.importance.select_top`) applies to the final ranking
only, and ``layer_floor=False`` keeps the ``k`` best logits globally, as the papers rank.

    >>> res = train_gates("pipelined-dsp", adapter, model, batches, n_keep=12,
    ...                   settings=GateSettings(cooldown=90))                       # doctest: +SKIP
    >>> len(res.kept)                                                              # doctest: +SKIP
    12
"""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from headbudget.pruning import importance
from headbudget.pruning.importance import Batch, LossFn, batch_to_device, default_loss, select_top, unflatten
from headbudget.pruning.job import require_positive
from headbudget.train.loop import LogRecord, TrainLoop

if TYPE_CHECKING:
    from headbudget.models.surgery import HeadAdapter

__all__ = ["DSP_COOLDOWN", "GATED_METHODS", "JOINT_METHODS", "PASS_METHODS", "GateResult", "GateSettings",
           "dsp_temperature", "gumbel_soft_top_k", "hard_concrete_gates", "hard_concrete_probs",
           "pass_sparsity_penalty", "train_gates"]

GATED_METHODS = ("pipelined-dsp", "joint-dsp", "joint-dsp-finetuned", "pass", "pass-frozen")
#: the methods whose model weights train with the gates
JOINT_METHODS = ("joint-dsp", "joint-dsp-finetuned", "pass")
#: the methods with PASS's hard-concrete gates (the others: DSP's soft top-k)
PASS_METHODS = ("pass", "pass-frozen")
# Published SST-5 cooldown steps (CAHP README, benchmark/dsp); MNLI: 4090 pipelined, 12272 joint.
DSP_COOLDOWN = {"pipelined-dsp": 90, "joint-dsp": 270, "joint-dsp-finetuned": 270}
# Hard-concrete constants of the PASS / DSP code (temperature, stretch limits, noise clamp).
HC_BETA, HC_LOW, HC_HIGH, HC_EPS = 0.33, -0.1, 1.1, 1e-6
# PASS schedule (fractions of the total steps) and clip bounds of the published SST-5 trainer.
PASS_COEFF_INIT, PASS_WARMUP, PASS_CLIMB, PASS_REOPEN, PASS_CLIP = 1e-5, 0.1, 0.45, 0.15, 5.0
_TINY = torch.finfo(torch.double).tiny


def check_job(job: Any) -> None:
    """The gate-training settings of a prune job (``gate_lr``, ``gate_epochs``, ``gate_cooldown``): a one-line
    ``ValueError`` naming the first bad one; registered as the check of every gate-training method."""
    if job.gate_lr <= 0:
        raise ValueError(f"gate_lr must be > 0, got {job.gate_lr}")
    require_positive(job, "gate_epochs", "gate_cooldown")


@dataclass
class GateSettings:
    """Gate-training settings (defaults: the published SST-5 ones; ``cooldown=None`` takes the variant's;
    ``max_grad_norm``: the clip of the logits' (and the joint methods' weights') gradient norm, 0 for none)."""

    lr: float = 0.5
    epochs: int = 1
    cooldown: int | None = None
    t_start: float = 1000.0
    t_end: float = 1e-8
    weight_lr: float = 2e-5
    max_grad_norm: float = 1.0
    seed: int = 0
    reopen: bool = True


@dataclass
class GateResult:
    """Kept flat indices (exactly ``n_keep``), final flat logits, per-step log and the settings used."""

    kept: list[int]
    logits: np.ndarray
    steps: int
    history: list[dict[str, float]] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- DSP
def dsp_temperature(step: int, cooldown: int, t_start: float = 1000.0, t_end: float = 1e-8) -> float:
    """Exponential annealing ``t_start -> t_end`` over ``cooldown`` steps (step 0: ``t_start``), then ``t_end``."""
    if step >= cooldown:
        return t_end
    return float(math.exp(math.log(t_start) - step / cooldown * (math.log(t_start) - math.log(t_end))))


def gumbel_soft_top_k(w: torch.Tensor, k: int, t: float, generator: torch.Generator | None = None,
                      noise: torch.Tensor | None = None) -> torch.Tensor:
    """Relaxed k-hot mask of the Gumbel-perturbed logits ``w`` (float64): ``k`` softmaxes at temperature
    ``t``, each after adding ``log(1 - p_prev)`` so the mass taken by the previous one is discounted.
    ``noise`` (standard Gumbel, same shape) replaces the sampled noise."""
    w = w.double()
    if noise is None:
        u = torch.rand(w.shape, generator=generator, dtype=torch.float64).to(w.device) * (1 - _TINY) + _TINY
        noise = -torch.log(-torch.log(u))
    r, total = w + noise.to(w), torch.zeros_like(w)
    for _ in range(k):
        p = torch.softmax(r / t, 0)
        total = total + p
        r = r + torch.log(torch.clamp(1 - p, min=_TINY))
    return total


# --------------------------------------------------------------------------- PASS
def hard_concrete_gates(log_a: torch.Tensor, train: bool, generator: torch.Generator | None = None) -> torch.Tensor:
    """Hard-concrete gates in [0, 1]: sampled in training, ``clip(sigmoid(log_a) * 1.2 - 0.1)`` otherwise."""
    if train:
        u = torch.rand(log_a.shape, generator=generator, dtype=torch.float32).to(log_a) * (1 - 2 * HC_EPS) + HC_EPS
        s = torch.sigmoid((torch.log(u) - torch.log(1 - u) + log_a) / HC_BETA)
    else:
        s = torch.sigmoid(log_a)
    return torch.clamp(s * (HC_HIGH - HC_LOW) + HC_LOW, 0.0, 1.0)


def hard_concrete_probs(log_a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``P(g = 0)``, ``P(g = 1)`` and ``P(0 < g < 1)`` per gate (each clamped to [1e-6, 1 - 1e-6])."""
    p0 = torch.sigmoid(HC_BETA * math.log(-HC_LOW / HC_HIGH) - log_a)
    p1 = torch.sigmoid(log_a - HC_BETA * math.log((1 - HC_LOW) / (HC_HIGH - 1)))
    lo, hi = HC_EPS, 1.0 - HC_EPS
    return p0.clamp(lo, hi), p1.clamp(lo, hi), (1 - (p0 + p1)).clamp(lo, hi)


def pass_sparsity_penalty(log_a: torch.Tensor, target_sparsity: float) -> torch.Tensor:
    """``|s N - sum P(g=0)| + |(1 - s) N - sum P(g=1)| + sum P(0 < g < 1)`` (almost-sure sparsity)."""
    n = log_a.numel()
    p0, p1, pnb = hard_concrete_probs(log_a)
    return (torch.abs(target_sparsity * n - p0.sum()) + torch.abs((1 - target_sparsity) * n - p1.sum())
            + pnb.sum())


# --------------------------------------------------------------------------- training
def _xavier_logits(counts: Sequence[int], method: str, generator: torch.Generator) -> torch.Tensor:
    """Initial logits as the authors' code draws them: DSP ``xavier_uniform`` on ``[layers, heads]``,
    PASS one ``xavier_uniform`` per layer on ``[1, heads, 1, 1]`` (fan in = heads, fan out = 1)."""
    fans = [n + 1 if method in PASS_METHODS else len(counts) + max(counts) for n in counts]
    return torch.cat([(torch.rand(n, generator=generator, dtype=torch.float64) * 2 - 1) * math.sqrt(6.0 / fan)
                      for n, fan in zip(counts, fans)])


def _confidence_patch(adapter: HeadAdapter, confidence: torch.Tensor, offsets: list[int]) -> Any:
    """A factory of contexts that add each head's mean (over batch and queries) max pre-softmax attention score to
    ``confidence`` (PASS's reopen probabilities); ``None`` when the family has no eager attention."""
    from headbudget.pruning.attattr import _expand_kv, patched_eager_attention, supports_attention_patch

    if not supports_attention_patch(adapter):
        return None
    layer_of = {id(adapter.attention_module(li)): li for li in range(adapter.num_layers)}

    def wrapper(orig: Any, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Any, *args: Any, **kwargs: Any) -> Any:
        li = layer_of.get(id(module))
        if li is not None:
            with torch.no_grad():
                scaling = query.shape[-1] ** -0.5 if kwargs.get("scaling") is None else kwargs["scaling"]
                k = _expand_kv(key, query.shape[1])
                scores = torch.matmul(query, k.transpose(-1, -2)).float() * scaling
                conf = scores.max(-1).values.mean((0, 2)).to(confidence)
                confidence[offsets[li] : offsets[li] + conf.numel()] += conf
        return orig(module, query, key, value, attention_mask, *args, **kwargs)

    return lambda: patched_eager_attention(adapter, wrapper)


def train_gates(method: str, adapter: HeadAdapter, model: torch.nn.Module, batches: Sequence[Batch],
                n_keep: int, settings: GateSettings | None = None, loss_fn: LossFn = default_loss,
                progress: bool = True, layer_floor: bool = True) -> GateResult:
    """Train head logits with ``method`` (one of :data:`GATED_METHODS`) on ``batches`` for ``settings.epochs``
    passes (:class:`headbudget.train.loop.TrainLoop`, one step per batch) and keep exactly ``n_keep`` heads
    by logit rank (at least one per layer unless ``layer_floor`` is off).  Pipelined DSP and ``pass-frozen``
    leave every model weight untouched; the :data:`JOINT_METHODS` update the weights in place at
    ``settings.weight_lr`` (from the pre-trained or the fine-tuned model: the caller's choice)."""
    from headbudget.progress import ProgressBar

    s = settings or GateSettings()
    counts = list(adapter.head_counts())
    cooldown = _check_gate_training(method, counts, n_keep, batches, s, layer_floor)
    joint = method in JOINT_METHODS
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(int(s.seed))
    init = _xavier_logits(counts, method, gen).to(device)
    # PASS trains float32 logits; DSP's authors keep them in float64
    logits = torch.nn.Parameter(init.float() if method in PASS_METHODS else init)
    total_steps = s.epochs * len(batches)
    trained = _GateParams(logits, [p for p in model.parameters() if p.requires_grad] if joint else [])
    opt, sched = _gate_optimizer(logits, list(trained.weights), s, total_steps)
    pas = _PassState.start(adapter, counts, n_keep, total_steps, s) if method in PASS_METHODS else None
    step_of = _GateStep(adapter, model, logits, counts, n_keep, cooldown, s, gen, loss_fn, device, pas)
    history: list[dict[str, float]] = []
    pending: list[tuple[dict[str, float], torch.Tensor]] = []  # the step being trained: its record, its task loss

    def gate_loss(batch: Batch) -> torch.Tensor:
        loss, task_loss, rec = step_of(len(history), batch)
        pending.append((rec, task_loss.detach()))
        return loss

    def log(_: LogRecord) -> None:  # every step: the task loss (without PASS's penalty), read as the old loop did
        rec, task_loss = pending.pop()
        history.append({**rec, "loss": float(task_loss)})

    # PASS's bookkeeping reads and resets the logits after backward, before the optimizer step (it commutes with
    # the gradient clipping, which reads and scales only the gradients)
    hook = opt.register_step_pre_hook(lambda *_: pas.after_backward(logits, len(history), total_steps)) \
        if pas is not None else None
    loop = TrainLoop(trained, opt, gate_loss, grad_clip=s.max_grad_norm, lr_schedule=sched, nonfinite="ignore")
    bar = ProgressBar(total=total_steps, desc=f"{method} gates", disable=not progress, leave=False)
    try:
        frozen = contextlib.nullcontext() if joint else importance.frozen_params(model)
        with frozen, importance._model_mode(model, True), seeded_dropout(s.seed, device):
            loop.run((batch for _epoch in range(s.epochs) for batch in batches), steps=total_steps,
                     log_at=lambda done: True, on_log=log, on_step=lambda done, _rec: bar.update(1))
    finally:
        bar.close()
        if hook is not None:
            hook.remove()
    final = logits.detach().double().cpu().numpy()
    kept = select_top(unflatten(final, counts), n_keep, layer_floor=layer_floor)
    return GateResult(kept=kept, logits=final, steps=len(history), history=history,
                      info=_gate_info(method, s, len(history), n_keep, cooldown, pas))


@contextlib.contextmanager
def seeded_dropout(seed: int, device: torch.device) -> Iterator[None]:
    """torch's global generators (CPU and ``device``'s) seeded with ``seed`` inside the block, restored after:
    dropout draws from them, so a gate selection depends on its seed alone, not on what ran before."""
    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
        torch.manual_seed(int(seed))
        yield


class _GateParams(torch.nn.Module):
    """What gate training updates, for :class:`~headbudget.train.loop.TrainLoop`: the logits, then (joint DSP)
    the model's trainable weights, in the order their gradient norm is taken; frozen weights are not seen."""

    def __init__(self, logits: torch.nn.Parameter, weights: list[torch.nn.Parameter]) -> None:
        super().__init__()
        self.logits = logits
        self.weights = torch.nn.ParameterList(weights)


def _check_gate_training(method: str, counts: list[int], n_keep: int, batches: Sequence[Batch],
                         s: GateSettings, layer_floor: bool = True) -> int:
    """A one-line ``ValueError`` for settings gate training cannot run with; else the DSP cooldown in steps."""
    if method not in GATED_METHODS:
        raise ValueError(f"unknown gate-training method {method!r}; choose from {', '.join(GATED_METHODS)}")
    n_total = sum(counts)
    low = len(counts) if layer_floor else 1
    if not low <= n_keep < n_total:
        raise ValueError(f"cannot keep {n_keep} heads: need between {low}{' (one per layer)' if layer_floor else ''} "
                         f"and {n_total - 1}")
    if not batches:
        raise ValueError("no training batches for gate training (empty training data?)")
    if s.lr <= 0 or s.epochs < 1:
        raise ValueError(f"gate training needs lr > 0 and epochs >= 1, got lr {s.lr}, epochs {s.epochs}")
    cooldown = s.cooldown if s.cooldown is not None else DSP_COOLDOWN.get(method, 0)
    if method not in PASS_METHODS and cooldown < 1:
        raise ValueError(f"{method}: cooldown must be >= 1 step, got {cooldown}")
    return cooldown


def _gate_optimizer(logits: torch.nn.Parameter, weights: list[torch.nn.Parameter], s: GateSettings,
                    total_steps: int) -> tuple[torch.optim.Optimizer, Any]:
    """The authors' AdamW (0.9, 0.999, eps 1e-8, no weight decay) over the logits (and, joint DSP, the weights
    at ``weight_lr``) with the learning rate decayed linearly to 0."""
    groups = [{"params": weights, "lr": s.weight_lr}] if weights else []
    groups.append({"params": [logits], "lr": s.lr})
    opt = torch.optim.AdamW(groups, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: max(0.0, (total_steps - step) / total_steps))
    return opt, sched


@dataclass
class _PassState:
    """PASS's schedule state: the penalty coefficient and its climb, the reopen period and the attention
    confidence the reopen probabilities come from."""

    target_sparsity: float
    closed_target: int
    warmup: int
    climb: int
    reopen_every: int
    confidence: torch.Tensor
    rng: random.Random
    patch: Any  # a factory of attention-patch contexts filling ``confidence``; None: no reopening
    coeff: float = PASS_COEFF_INIT
    climb_counter: int = 0
    reopened: int = 0

    @classmethod
    def start(cls, adapter: HeadAdapter, counts: list[int], n_keep: int, total_steps: int, s: GateSettings) -> _PassState:
        n_total = sum(counts)
        sparsity = 1.0 - n_keep / n_total
        conf = torch.zeros(n_total, dtype=torch.float64)
        offsets = [0, *np.cumsum(counts).tolist()]
        return cls(target_sparsity=sparsity, closed_target=int(sparsity * n_total),
                   warmup=int(total_steps * PASS_WARMUP), climb=max(1, int(total_steps * PASS_CLIMB)),
                   reopen_every=int(total_steps * PASS_REOPEN), confidence=conf,
                   rng=random.Random(int(s.seed)),
                   patch=_confidence_patch(adapter, conf, offsets) if s.reopen else None)

    def after_backward(self, logits: torch.nn.Parameter, step: int, total_steps: int) -> None:
        self.coeff, self.climb_counter, reopened = _pass_schedule(
            logits, step, self.coeff, self.climb_counter, self.warmup, self.climb, self.reopen_every, total_steps,
            self.closed_target, self.confidence, self.rng, self.patch is not None)
        self.reopened += reopened


@dataclass
class _GateStep:
    """One gate-training step up to the loss: sample the relaxed mask and forward with it; returns (the loss to
    backward: the task loss, plus PASS's sparsity penalty; the task loss; the step's log record)."""

    adapter: HeadAdapter
    model: torch.nn.Module
    logits: torch.nn.Parameter
    counts: list[int]
    n_keep: int
    cooldown: int
    s: GateSettings
    gen: torch.Generator
    loss_fn: LossFn
    device: torch.device
    pas: _PassState | None

    def __call__(self, step: int, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        rec: dict[str, float] = {"step": float(step)}
        pas = self.pas
        if pas is not None:
            mask = hard_concrete_gates(self.logits, True, self.gen)
        else:
            rec["temperature"] = t = dsp_temperature(step, self.cooldown, self.s.t_start, self.s.t_end)
            mask = gumbel_soft_top_k(self.logits, self.n_keep, t, self.gen).float()
        confidence = pas.patch() if pas is not None and pas.patch else contextlib.nullcontext()
        with self.adapter.gate_hooks(list(torch.split(mask, self.counts))), confidence:
            task_loss = self.loss_fn(self.model, batch_to_device(batch, self.device))
        if pas is None:
            return task_loss, task_loss, rec
        rec["reg_coeff"] = pas.coeff
        return task_loss + pas.coeff * pass_sparsity_penalty(self.logits, pas.target_sparsity), task_loss, rec


def _gate_info(method: str, s: GateSettings, steps: int, n_keep: int, cooldown: int,
               pas: _PassState | None) -> dict[str, Any]:
    """The settings a gate training ran with and where it ended (``details.json``'s ``gate_training``)."""
    info: dict[str, Any] = {"method": method, "lr": s.lr, "epochs": s.epochs, "steps": steps, "target_heads": n_keep}
    if pas is not None:
        info.update(target_sparsity=pas.target_sparsity, final_reg_coeff=pas.coeff, reopen=pas.patch is not None,
                    reopened=pas.reopened)
    else:
        info.update(cooldown=cooldown, t_start=s.t_start, t_end=s.t_end,
                    final_temperature=dsp_temperature(max(steps - 1, 0), cooldown, s.t_start, s.t_end),
                    cooled_down=steps > cooldown)
    if method in JOINT_METHODS:
        info["weight_lr"] = s.weight_lr
    return info


def _pass_schedule(logits: torch.nn.Parameter, step: int, coeff: float, counter: int, warmup: int, climb: int,
                   reopen_every: int, total_steps: int, closed_target: int, confidence: torch.Tensor,
                   rng: random.Random, can_reopen: bool) -> tuple[float, int, int]:
    """One step of the published PASS trainer's bookkeeping (after backward, before the optimiser step):
    grow the penalty coefficient while the gates are not at the target, and periodically clip the
    logits to [-5, 5] and reopen closed gates with probability = normalised attention confidence."""
    with torch.no_grad():
        la = logits.detach()
        closed = int((la <= -PASS_CLIP).sum())
        opened = int((la >= PASS_CLIP).sum())
        if step > warmup and (closed != closed_target or opened != la.numel() - closed_target):
            coeff = PASS_COEFF_INIT * 1000 ** (counter / climb)
            counter += 1
        reopened = 0
        if reopen_every > 0 and warmup < step < total_steps * 0.95 and step % reopen_every == 0:
            new = la.clamp(-PASS_CLIP, PASS_CLIP).clone()
            if can_reopen:
                top = float(confidence.max())
                norm = confidence / top if top != 0 else torch.zeros_like(confidence)
                for i in range(new.numel()):
                    if new[i] <= -PASS_CLIP and rng.uniform(0, 1) < float(norm[i]):
                        new[i] = PASS_CLIP
                        reopened += 1
                confidence.zero_()
            logits.data.copy_(new)
    return coeff, counter, reopened


def check_joint_job(job: Any) -> None:
    """The authors' joint protocols (joint-dsp, pass): the gate checks, a pre-trained model for a classifier."""
    check_job(job)
    if job.task != "lm" and job.pretrained is None:
        raise ValueError(f"method {job.method} trains from the pre-trained model, as its authors do: give it "
                         f"(pretrained / --pretrained MODEL), or use {job.method}"
                         f"{'-finetuned' if job.method == 'joint-dsp' else '-frozen'} to start from the fine-tuned "
                         "model")
    require_positive(job, "joint_epochs")
