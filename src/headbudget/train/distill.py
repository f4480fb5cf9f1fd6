"""Logit distillation for the trainer: the teacher (loaded frozen), the same-tokenizer check and the loss.

:class:`~headbudget.train.trainer.Trainer` uses these when ``distill.teacher`` is set
(``headbudget distill STUDENT --teacher TEACHER ...`` or ``headbudget train CONFIG --init STUDENT --teacher
TEACHER``); the loop, checkpoints, resume and DDP/FSDP2 are the trainer's own.

    >>> import torch
    >>> from headbudget.train.distill import distillation_kl
    >>> s, t = torch.zeros(1, 2, 5), torch.zeros(1, 2, 5)
    >>> float(distillation_kl(s, t, temperature=2.0))          # same distribution: no divergence
    0.0

The teacher runs in eval mode under ``no_grad`` on the student's device, one full copy per process: under
DDP every rank loads it, under FSDP2 it is *not* sharded (only the student is), so it must fit on each
device next to the student's shard.
"""

from __future__ import annotations

import hashlib
import json
import math
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
    """The teacher model of ``distill.teacher``: frozen (no parameter requires grad), eval mode, on ``device``.

    Refuses in one line a teacher whose tokenizer differs from ``student_tok`` or that has none saved.

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
                    temperature: float = 1.0, ignore_index: int = -100) -> torch.Tensor:
    """``T^2 * KL(softmax(teacher/T) || softmax(student/T))`` averaged over tokens (positions whose target is
    ``ignore_index`` left out), computed in float32.  Logits are ``(..., vocab)`` with the same vocab."""
    t = temperature
    log_ps = F.log_softmax(student_logits.float() / t, dim=-1)
    log_pt = F.log_softmax(teacher_logits.float() / t, dim=-1)
    per_token = F.kl_div(log_ps, log_pt, reduction="none", log_target=True).sum(-1)
    if targets is not None:
        per_token = per_token[targets != ignore_index]
    return per_token.mean() * (t * t)


def distill_step_loss(student: torch.nn.Module, teacher: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                      temperature: float, alpha: float, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss to backpropagate, detached [kl, ce]) of one micro-batch: ``alpha * kl + (1 - alpha) * ce``.

    ``alpha == 0`` backpropagates the cross-entropy alone (bit-identical to plain LM training; the KL is
    still measured, without gradient).  Logits of different widths (vocabularies padded differently) are
    compared over the tokenizer's ``vocab`` ids."""
    logits = student(input_ids=x, use_cache=False).logits
    ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))
    with torch.no_grad():
        t_logits = teacher(input_ids=x, use_cache=False).logits
    s_logits = logits
    if t_logits.size(-1) != s_logits.size(-1):
        s_logits, t_logits = s_logits[..., :vocab], t_logits[..., :vocab]
    if alpha == 0:
        with torch.no_grad():
            kl = distillation_kl(s_logits, t_logits, y, temperature)
        loss = ce
    else:
        kl = distillation_kl(s_logits, t_logits, y, temperature)
        loss = kl if alpha == 1 else alpha * kl + (1 - alpha) * ce
    return loss, torch.stack([kl.detach(), ce.detach()])


__all__ = ["TokenizerMismatchError", "check_same_tokenizer", "distill_step_loss", "distillation_kl",
           "load_teacher", "tokenizer_digest"]
