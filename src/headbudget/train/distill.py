"""Logit distillation for the trainer: the teacher (loaded frozen), the same-tokenizer check and the loss.

:class:`~headbudget.train.trainer.Trainer` uses these when ``distill.teacher`` is set (``headbudget distill``,
``train --teacher``).  The teacher is one full copy per process (never sharded), so it must fit on each
device next to the student's shard.  See docs/training.md ("Recovering ... by distillation").

    >>> import torch
    >>> from headbudget.train.distill import distillation_kl
    >>> s, t = torch.zeros(1, 2, 5), torch.zeros(1, 2, 5)
    >>> float(distillation_kl(s, t, temperature=2.0))          # same distribution: no divergence
    0.0
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from headbudget.train.config import DistillSection


class TokenizerMismatchError(ValueError):
    """Teacher and student do not share a tokenizer (one line: what differs)."""


def tokenizer_digest(tokenizer: Any) -> tuple[int, str]:
    """(number of tokens, sha256 of the token -> id map) of a Hugging Face tokenizer: equal digests mean
    every text becomes the same ids (added special tokens included, as ``get_vocab`` lists them)."""
    vocab = tokenizer.get_vocab()
    blob = json.dumps(sorted(vocab.items(), key=lambda kv: (kv[1], kv[0])), ensure_ascii=False)
    return len(vocab), hashlib.sha256(blob.encode("utf-8")).hexdigest()


def check_same_tokenizer(student_tok: Any, teacher_tok: Any, teacher: str) -> None:
    """A one-line :class:`TokenizerMismatchError` unless both tokenizers map the same tokens to the same ids."""
    (n_s, h_s), (n_t, h_t) = tokenizer_digest(student_tok), tokenizer_digest(teacher_tok)
    if n_s != n_t:
        raise TokenizerMismatchError(
            f"distill.teacher={teacher}: its tokenizer has {n_t} tokens, the student's {n_s}; distillation "
            "needs teacher and student to share one tokenizer")
    if h_s != h_t:
        vs, vt = student_tok.get_vocab(), teacher_tok.get_vocab()
        first = next((tok for tok, i in sorted(vs.items(), key=lambda kv: kv[1]) if vt.get(tok) != i), "?")
        raise TokenizerMismatchError(
            f"distill.teacher={teacher}: its tokenizer differs from the student's (both {n_s} tokens, but "
            f"token {first!r} is id {vs.get(first)} for the student and {vt.get(first)} for the teacher); "
            "distillation needs teacher and student to share one tokenizer")


def check_distill_section(d: DistillSection) -> None:
    """One-line errors for a bad ``distill`` section (temperature, alpha, a teacher that does not resolve),
    before any data work; nothing to check while ``d.teacher`` is null.

    >>> check_distill_section(DistillSection(teacher="runs/dense/model", temperature=0.0))  # doctest: +SKIP
    ValueError: distill.temperature must be a positive number, got 0.0
    """
    if not d.teacher:
        return
    if not (math.isfinite(d.temperature) and d.temperature > 0):
        raise ValueError(f"distill.temperature must be a positive number, got {d.temperature}")
    if not 0 <= d.alpha <= 1:
        raise ValueError(f"distill.alpha must be between 0 and 1 (the weight of the KL term), got {d.alpha}")
    from headbudget.loading import resolve_model

    try:  # a missing teacher before any data work
        resolve_model(d.teacher)
    except (FileNotFoundError, ValueError) as exc:
        raise type(exc)(f"distill.teacher: {exc}") from None


def load_teacher(teacher: str, student_tok: Any, device: torch.device, dtype: torch.dtype = torch.float32):
    """The teacher model of ``distill.teacher``: frozen, eval mode, on ``device``; refused in one line when
    its tokenizer differs from ``student_tok`` or is not saved.

    >>> tok = load_tokenizer(model_dir="runs/pruned/model")                        # doctest: +SKIP
    >>> t = load_teacher("runs/quickstart-dense/model", tok, torch.device("cpu"))  # doctest: +SKIP
    """
    from headbudget.loading import load_model, load_tokenizer

    try:
        teacher_tok = load_tokenizer(model_dir=teacher)
    except ValueError as exc:
        raise TokenizerMismatchError(f"distill.teacher={teacher}: cannot check that it shares the student's "
                                     f"tokenizer ({exc})") from None
    check_same_tokenizer(student_tok, teacher_tok, teacher)
    model = load_model(teacher, kind="causal", dtype=dtype, device=device)
    model.eval().requires_grad_(False)
    out = model.get_output_embeddings()
    if out is not None and int(out.weight.shape[0]) < len(student_tok):
        raise ValueError(f"distill.teacher={teacher}: its output layer has {out.weight.shape[0]} rows, fewer "
                         f"than the tokenizer's {len(student_tok)} tokens")
    return model


def distillation_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, targets: torch.Tensor | None = None,
                    temperature: float = 1.0, ignore_index: int = -100, rows: int = 16) -> torch.Tensor:
    """``T^2 * KL(softmax(teacher/T) || softmax(student/T))`` averaged over tokens (positions whose target is
    ``ignore_index`` left out), computed in float32.  Logits are ``(..., vocab)`` with the same vocab.

    Forward and backward go ``rows`` tokens at a time and keep no vocabulary-wide float32 copy: the gradient is
    ``T * (softmax(s/T) - softmax(t/T))`` per token, written straight into the student logits' dtype."""
    s = student_logits.reshape(-1, student_logits.size(-1))
    t = teacher_logits.reshape(-1, teacher_logits.size(-1)).detach()
    keep = torch.ones(s.size(0), dtype=torch.float32, device=s.device) if targets is None else \
        (targets.reshape(-1) != ignore_index).float()
    return _ChunkedKL.apply(s, t, keep / keep.sum(), float(temperature), rows)


class _ChunkedKL(torch.autograd.Function):
    """Sum over tokens of ``weight * T^2 * KL`` by chunks of rows (see :func:`distillation_kl`)."""

    @staticmethod
    def forward(ctx: Any, s: torch.Tensor, t: torch.Tensor, weight: torch.Tensor, temperature: float,
                rows: int) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=s.device)
        for i in range(0, s.size(0), rows):
            log_ps = F.log_softmax(s[i:i + rows].float() / temperature, dim=-1)
            log_pt = F.log_softmax(t[i:i + rows].float() / temperature, dim=-1)
            total += ((log_pt.exp() * (log_pt - log_ps)).sum(-1) * weight[i:i + rows]).sum()
        ctx.save_for_backward(s, t, weight)
        ctx.temperature, ctx.rows = temperature, rows
        return total * temperature * temperature

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        s, t, weight = ctx.saved_tensors
        temp, rows = ctx.temperature, ctx.rows
        grad = torch.empty_like(s)
        scale = weight * (temp * grad_out.float())
        for i in range(0, s.size(0), rows):
            diff = F.softmax(s[i:i + rows].float() / temp, dim=-1) - F.softmax(t[i:i + rows].float() / temp, dim=-1)
            grad[i:i + rows] = diff * scale[i:i + rows, None]
        return grad, None, None, None, None


def chunked_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                          rows: int = 64) -> torch.Tensor:
    """``F.cross_entropy(logits.float(), targets)`` (mean over the targets that are not ``ignore_index``), ``rows``
    tokens at a time, without a gradient (what distillation reports as ``lm_loss`` when it does not train on it)."""
    s, y = logits.reshape(-1, logits.size(-1)), targets.reshape(-1)
    total = torch.zeros((), dtype=torch.float32, device=s.device)
    for i in range(0, s.size(0), rows):
        part, tgt = s[i:i + rows].float(), y[i:i + rows]
        keep = tgt != ignore_index
        picked = part.gather(-1, tgt.clamp_min(0)[:, None])[:, 0]
        total += ((torch.logsumexp(part, -1) - picked) * keep).sum()
    return total / (y != ignore_index).sum()


def model_fingerprint(model: torch.nn.Module) -> str:
    """A digest of a model's parameter names, shapes, dtypes and bytes (which teacher a cache belongs to)."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().to("cpu").contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


class TeacherCache:
    """The teacher's last hidden states, computed once per batch and read back by every later student
    (``distill.teacher_cache``): a hit runs only the teacher's output layer on them, so the logits -- and the
    loss -- are exactly those of the full forward pass.  One file per batch of token ids (written atomically),
    under a folder named by the teacher's fingerprint; a teacher whose logits are not its output layer applied
    to that input (a soft-capped head, say) is refused on the first batch.

        >>> import tempfile
        >>> from headbudget.models import HeadBudgetConfig, HeadBudgetForCausalLM
        >>> teacher = HeadBudgetForCausalLM(HeadBudgetConfig.from_preset("cpu-tiny", "uniform", vocab_size=64))
        >>> cache, x = TeacherCache(tempfile.mkdtemp(), teacher), torch.randint(0, 64, (2, 8))
        >>> logits = cache.logits(x)        # the teacher's body runs only for a batch it has not seen
    """

    def __init__(self, root: str | Path, teacher: torch.nn.Module) -> None:
        self.teacher, self.head = teacher, teacher.get_output_embeddings()
        self.dir = Path(root) / model_fingerprint(teacher)[:24]
        self.hits = self.misses = 0

    def path(self, x: torch.Tensor) -> Path:
        ids = x.detach().to("cpu", torch.int64).contiguous()
        digest = hashlib.sha256(str(tuple(ids.shape)).encode() + ids.numpy().tobytes()).hexdigest()[:32]
        return self.dir / f"{digest}.safetensors"

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        from safetensors.torch import load_file, save_file

        from headbudget.io import atomic_write_file

        path = self.path(x)
        with torch.no_grad():
            if path.is_file():
                self.hits += 1
                return self.head(load_file(str(path))["hidden"].to(x.device))
            seen: list[torch.Tensor] = []
            hook = self.head.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach()))
            try:
                logits = self.teacher(input_ids=x, use_cache=False).logits
            finally:
                hook.remove()
            if self.misses == 0 and not torch.equal(self.head(seen[0]), logits):
                raise ValueError("distill.teacher_cache: the teacher's logits are not its output layer applied to its "
                                 "last hidden states (a soft-capped or scaled head?); run without the cache")
            self.misses += 1
            hidden = seen[0].to("cpu").contiguous()
            atomic_write_file(path, lambda tmp: save_file({"hidden": hidden}, str(tmp)))
            return logits


def distill_step_loss(student: torch.nn.Module, teacher: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                      temperature: float, alpha: float, vocab: int,
                      cache: TeacherCache | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss to backpropagate, detached [kl, ce]) of one micro-batch: ``alpha * kl + (1 - alpha) * ce``;
    ``alpha == 0`` is bit-identical to plain LM training (the KL measured without gradient).  Logits of
    different widths are compared over the tokenizer's ``vocab`` ids."""
    logits = student(input_ids=x, use_cache=False).logits
    if alpha == 1:  # the cross-entropy is only reported: no graph, no vocabulary-wide float32 copy
        with torch.no_grad():
            ce = chunked_cross_entropy(logits, y)
    else:
        ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))
    with torch.no_grad():
        t_logits = cache.logits(x) if cache is not None else teacher(input_ids=x, use_cache=False).logits
    if t_logits.size(-1) != logits.size(-1):
        logits, t_logits = logits[..., :vocab], t_logits[..., :vocab]
    with torch.no_grad() if alpha == 0 else contextlib.nullcontext():
        kl = distillation_kl(logits, t_logits, y, temperature)
    loss = ce if alpha == 0 else kl if alpha == 1 else alpha * kl + (1 - alpha) * ce
    return loss, torch.stack([kl.detach(), ce.detach()])


__all__ = ["TeacherCache", "TokenizerMismatchError", "check_same_tokenizer", "distill_step_loss", "distillation_kl",
           "load_teacher", "model_fingerprint", "tokenizer_digest"]
