"""AttAttr (Hao et al., AAAI 2021): attention-head importance by integrated gradients on the attention maps.

For every example ``x`` (its gold label ``c``) and every layer ``l`` with attention probabilities ``A``
(``[heads, T, T]``, one eager forward), the layer's maps are replaced by ``alpha A`` for ``alpha`` in
``0, 1/m, ..., (m-1)/m`` (the other layers run normally) and

    Attr(A) = A / m * sum_alpha dP(c | x; alpha A) / d(alpha A)

(``P`` the softmax probability of the gold class, as the authors' ``prune_attr`` script uses it).  A
head's score is the maximum of its attribution map, summed over the examples (published: ``m = 20``, the
first 200 evaluation examples; here the first 200 of the job's primary evaluation split, in file order).
Classification only, and only for model families that run Hugging Face's ``eager_attention_forward``
(BERT family, GPT-2, Llama-style): the maps are replaced by patching that function during a forward.
See docs/pruning.md, "Published baselines".

    >>> scores = attattr_scores(adapter, model, tokenizer, examples[:200], steps=20)  # doctest: +SKIP
    >>> kept = select_top(scores, 24)                                                  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from headbudget.pruning.job import require_positive

if TYPE_CHECKING:
    from headbudget.models.surgery import HeadAdapter

__all__ = ["attattr_scores", "check_job", "patched_eager_attention", "supports_attention_patch"]


def check_job(job: Any) -> None:
    """A prune job attattr can run: a classification task and at least one example and one integration step."""
    if job.task == "lm":
        raise ValueError("method attattr attributes a class probability: it needs a classification task "
                         "(sst5, mnli), not lm")
    require_positive(job, "attattr_examples", "attattr_steps")


AttentionWrapper = Callable[..., Any]


def _attention_modules(adapter: HeadAdapter) -> list[Any]:
    return [sys.modules.get(type(adapter.attention_module(li)).__module__) for li in range(adapter.num_layers)]


def supports_attention_patch(adapter: HeadAdapter) -> bool:
    """Whether every attention layer of ``adapter``'s model calls its module's ``eager_attention_forward``."""
    try:
        mods = _attention_modules(adapter)
    except (AttributeError, NotImplementedError):
        return False
    return all(m is not None and callable(getattr(m, "eager_attention_forward", None)) for m in mods)


@contextlib.contextmanager
def patched_eager_attention(adapter: HeadAdapter, wrapper: AttentionWrapper) -> Iterator[None]:
    """Inside the block every attention layer runs eager attention through
    ``wrapper(original, module, query, key, value, attention_mask, *args, **kwargs)``, which returns
    ``(attn_output, attn_weights)`` as the original does (``module`` tells the layers apart)."""
    if not supports_attention_patch(adapter):
        raise ValueError(f"attention maps of the {adapter.family!r} family cannot be replaced: its attention does "
                         "not run transformers' eager_attention_forward (AttAttr supports BERT-family, GPT-2 and "
                         "Llama-style models)")
    mods = {id(m): m for m in _attention_modules(adapter)}
    saved = {k: m.eager_attention_forward for k, m in mods.items()}
    with adapter.eager_attention():
        try:
            for k, m in mods.items():
                m.eager_attention_forward = functools.partial(wrapper, saved[k])
            yield
        finally:
            for k, m in mods.items():
                m.eager_attention_forward = saved[k]


def _expand_kv(value: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Value heads repeated for their query heads (grouped-query attention; consecutive, as ``repeat_kv``)."""
    return value if value.shape[1] == n_heads else value.repeat_interleave(n_heads // value.shape[1], dim=1)


def attattr_scores(adapter: HeadAdapter, model: torch.nn.Module, tokenizer: Any, examples: Sequence[Any],
                   steps: int = 20, max_length: int = 128, progress: bool = True) -> list[np.ndarray]:
    """Per layer, every head's AttAttr score: max over the head's ``[T, T]`` attribution map, summed over
    ``examples`` (:class:`headbudget.data.classification.Example`, one forward batch of ``steps`` scaled copies
    per example and layer).  Model weights get no gradient; the model is left in its train/eval mode."""
    from headbudget.data.classification import ClassificationCollator
    from headbudget.progress import ProgressBar
    from headbudget.pruning.importance import _model_mode, frozen_params

    if steps < 1:
        raise ValueError(f"attattr steps must be >= 1, got {steps}")
    if not examples:
        raise ValueError("attattr: no evaluation examples to attribute")
    collate = ClassificationCollator(tokenizer, max_length)
    device = next(model.parameters()).device
    modules = [adapter.attention_module(li) for li in range(adapter.num_layers)]
    totals = [torch.zeros(n, dtype=torch.float64) for n in adapter.head_counts()]
    alphas = torch.arange(steps, dtype=torch.float32, device=device) / steps  # 0, 1/m, ..., (m-1)/m
    target: dict[str, Any] = {}

    def wrapper(orig: Any, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Any, *args: Any, **kwargs: Any) -> Any:
        if module is not target.get("module"):
            return orig(module, query, key, value, attention_mask, *args, **kwargs)
        scaled = target["scaled"]
        out = torch.matmul(scaled.to(value.dtype), _expand_kv(value, scaled.shape[1]))
        return out.transpose(1, 2).contiguous(), scaled

    with _model_mode(model, False), frozen_params(model):
        for ex in ProgressBar(examples, desc="attattr", disable=not progress, leave=False):
            batch = collate([ex])
            label = int(batch.pop("labels")[0])
            inputs = {k: v.to(device) for k, v in batch.items()}
            probs = adapter.attention_probs(**inputs)
            copies = {k: v.expand(steps, *v.shape[1:]) for k, v in inputs.items()}
            for li, module in enumerate(modules):
                a = probs[li][0].float()  # [H, T, T]
                scaled = (alphas.view(-1, 1, 1, 1) * a).requires_grad_(True)
                target.update(module=module, scaled=scaled)
                with patched_eager_attention(adapter, wrapper):
                    logits = model(**copies).logits
                prob = torch.softmax(logits.float(), dim=-1)[:, label]
                (grad,) = torch.autograd.grad(prob.sum(), scaled)
                totals[li] += (a * grad.sum(0) / steps).flatten(1).max(1).values.double().cpu()
                target.clear()
    return [t.numpy() for t in totals]
