"""Attention analysis: how far each head looks (the paper's local-to-global evidence).

Per head, averaged over query positions and sequences of attention probabilities ``p`` (B, H, T, T): the
**distance** (expected ``|i - j|`` under the row ``p[i, :]``), the **entropy** (nats) and the **local_share**
(mass on keys with ``|i - j| < local_window``, the query's own included).  :func:`attention_summary` returns
``{"local_window", "n_sequences", "n_tokens", "plain_average_distance", "layers": [{"layer", "n_heads",
"distance", "entropy", "local_share", "mean_distance", "mean_entropy", "mean_local_share"}, ...],
"mean_distance", "mean_entropy", "mean_local_share"}`` (JSON-able; layers may have different head counts).
See docs/evaluation.md ("Attention analysis").

    s1 = attention_summary(model_uniform, input_ids, local_window=8)   # runs output_attentions=True
    s2 = attention_summary_from_text(model_prism, tokenizer, text, seq_len=128, n_seqs=4)
    plot_distance_comparison({"uniform": s1, "prism": s2}, "compare.png")

:func:`run_attention` is ``headbudget attention``'s whole run from its :class:`AttentionSettings`: each model
loaded and summarized, its JSON and plot written, then the comparison plot.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from headbudget.io import atomic_write_json, new_figure, read_text, save_figure
from headbudget.loading import ModelSettings
from headbudget.typed_config import option

if TYPE_CHECKING:
    import torch

__all__ = ["AttentionSettings", "attention_stats", "attention_summary", "attention_summary_from_text",
           "plot_distance", "plot_distance_comparison", "run_attention", "write_json"]

_STATS = ("distance", "entropy", "local_share")


@dataclass(kw_only=True)
class AttentionSettings(ModelSettings):
    """``headbudget attention``'s settings: the model (:class:`~headbudget.loading.ModelSettings`), the text,
    the output folder, a second model to compare and the sequences summarized, each field one flag.

        >>> settings = AttentionSettings(model="runs/uniform", compare="runs/prism", data="tinyshakespeare.txt",
        ...                              out="attn")
        >>> summaries = run_attention(settings)          # {"uniform": ..., "prism": ...}    # doctest: +SKIP
    """

    data: str = option(help="text file, or HF dataset NAME[:CONFIG]")
    out: str = option(help="output directory")
    compare: str | None = option(None, help="a second model, plotted side by side")
    seq_len: int = option(128, help="tokens per sequence")
    n_seqs: int = option(4, help="sequences averaged")
    local_window: int = option(8, help="distance counted as local (local share)")


def run_attention(settings: AttentionSettings, out: str | Path | None = None, *,
                  on_model: Callable[[str, dict[str, Any]], None] | None = None) -> dict[str, dict[str, Any]]:
    """``headbudget attention``: :func:`attention_summary_from_text` of ``settings.data`` under MODEL and, with
    ``settings.compare``, the second model, each written to ``out`` (default ``settings.out``) as
    ``attention_<label>.json`` and ``distance_<label>.png``, then ``distance_comparison.png`` with two models.
    A label is the model folder's name (``<name>_1`` for a compared model of the same name).  Returns
    ``{label: summary}``; ``on_model(label, summary)`` is called as each model's files are written (the command
    prints its line then, while the next model loads).

        >>> s = run_attention(AttentionSettings(model="runs/uniform", data="tiny.txt", out="attn"))  # doctest: +SKIP
        >>> s["uniform"]["mean_distance"]                                                         # doctest: +SKIP
    """
    settings.resolved_device()  # a bad --device or --dtype: one error line before the text is read
    text = read_text(settings.data)
    out = Path(out or settings.out)
    models = [settings.model] + ([settings.compare] if settings.compare else [])
    summaries: dict[str, dict[str, Any]] = {}
    for i, name in enumerate(models):
        model, tok = settings.load(name if i else None)
        s = attention_summary_from_text(model, tok, text, seq_len=settings.seq_len, n_seqs=settings.n_seqs,
                                        local_window=settings.local_window)
        label = Path(str(name).rstrip("/")).name or str(name)
        if label in summaries:
            label = f"{label}_{i}"
        summaries[label] = s
        write_json(s, out / f"attention_{label}.json")
        plot_distance(s, out / f"distance_{label}.png", title=f"{label}: mean attention distance")
        if on_model is not None:
            on_model(label, s)
    if len(summaries) > 1:
        plot_distance_comparison(summaries, out / "distance_comparison.png")
    return summaries


def _per_query(probs: torch.Tensor, local_window: int) -> tuple[torch.Tensor, ...]:
    """Per-(batch, head, query) distance, entropy and local share of probs (B, H, Tq, Tk); queries are aligned
    to the *last* Tq keys (Tq == Tk without a cache)."""
    import torch

    p = probs.float()
    tq, tk = p.shape[-2], p.shape[-1]
    qpos = torch.arange(tk - tq, tk, device=p.device, dtype=torch.float32)[:, None]
    dist = (qpos - torch.arange(tk, device=p.device, dtype=torch.float32)[None, :]).abs()  # (Tq, Tk)
    entropy = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)
    return (p * dist).sum(-1), entropy, (p * (dist < local_window)).sum(-1)


def attention_stats(probs: torch.Tensor, local_window: int = 8,
                    query_mask: torch.Tensor | None = None) -> dict[str, list[float]]:
    """Per-head mean distance, entropy and local share of ``probs`` (B, H, T, T) or (H, T, T); ``query_mask``
    (B, T), 1 for real tokens, drops padded query rows from the averages.

        >>> import torch
        >>> p = torch.tensor([[[1.0, 0.0], [0.5, 0.5]]])   # one head, 2 tokens
        >>> attention_stats(p, local_window=1)["distance"]
        [0.25]
    """
    import torch

    if probs.dim() == 3:
        probs = probs[None]
    if probs.dim() != 4:
        raise ValueError(f"attention probs must be (B, H, T, T), got shape {tuple(probs.shape)}")
    if local_window < 1:
        raise ValueError(f"local_window must be >= 1, got {local_window}")
    w = (torch.ones(probs.shape[0], probs.shape[-2], device=probs.device) if query_mask is None
         else query_mask[:, -probs.shape[-2]:].float().to(probs.device))
    return {k: [float(v) for v in (x * w[:, None, :]).sum(dim=(0, 2)) / w.sum().clamp_min(1.0)]
            for k, x in zip(_STATS, _per_query(probs, local_window))}  # (B, H, Tq) each


def _attentions(model: torch.nn.Module, input_ids: torch.Tensor,
                attention_mask: torch.Tensor | None) -> Sequence[torch.Tensor]:
    kwargs: dict[str, Any] = {"output_attentions": True, "use_cache": False}
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    atts = getattr(model(input_ids=input_ids, **kwargs), "attentions", None)
    # Hugging Face models on SDPA/flash kernels return no probabilities: switch to eager.
    if (not atts or any(a is None for a in atts)) and hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("eager")
        atts = getattr(model(input_ids=input_ids, **kwargs), "attentions", None)
    if not atts or any(a is None for a in atts):
        raise ValueError(f"{type(model).__name__} returned no attention probabilities "
                         "with output_attentions=True")
    return atts


def attention_summary(model: torch.nn.Module, input_ids: torch.Tensor, local_window: int = 8,
                      attention_mask: torch.Tensor | None = None, batch_size: int = 1) -> dict[str, Any]:
    """Per-layer, per-head attention statistics of ``model`` on ``input_ids`` (B, T), ``batch_size`` sequences
    at a time, averaged over every query position of every sequence (``attention_mask``: padding left out)."""
    import torch

    from headbudget.devices import scoring_mode

    ids = torch.atleast_2d(torch.as_tensor(input_ids, dtype=torch.long))
    dev = next(model.parameters()).device
    sums: list[dict[str, torch.Tensor]] = []
    total_w, plain_sum = 0.0, 0.0
    with scoring_mode(model):
        for b in range(0, ids.shape[0], batch_size):
            chunk = ids[b: b + batch_size].to(dev)
            mask = attention_mask[b: b + batch_size].to(dev) if attention_mask is not None else None
            w = mask.float() if mask is not None else torch.ones(chunk.shape, device=dev)
            for layer, probs in enumerate(_attentions(model, chunk, mask)):
                ww = w[:, None, -probs.shape[-2]:]
                acc = {k: (x * ww).sum((0, 2)) for k, x in zip(_STATS, _per_query(probs, local_window))}
                if layer == len(sums):
                    sums.append(acc)
                else:
                    sums[layer] = {k: sums[layer][k] + acc[k] for k in acc}
            total_w += float(w.sum())
            # a plain average over the j + 1 real tokens up to a query (its j-th real token) has distance j / 2
            plain_sum += float((w * (w.cumsum(-1) - 1).clamp_min(0) / 2).sum())
    layers = []
    for i, acc in enumerate(sums):
        row: dict[str, Any] = {"layer": i, "n_heads": int(acc["distance"].numel())}
        for k in _STATS:
            row[k] = vals = [float(v) for v in acc[k] / max(total_w, 1.0)]
            row[f"mean_{k}"] = sum(vals) / len(vals) if vals else float("nan")
        layers.append(row)
    return {"local_window": local_window, "n_sequences": int(ids.shape[0]),
            "n_tokens": int(ids.shape[1]), "layers": layers,
            # the mean distance if every head averaged its causal prefix evenly: what "no preference" reads as
            "plain_average_distance": plain_sum / max(total_w, 1.0),
            **{f"mean_{k}": [r[f"mean_{k}"] for r in layers] for k in _STATS}}


def _leading_ids(tokenizer: Any, text: str, need: int) -> list[int]:
    """The ids of ``text`` (no special tokens), encoding only a prefix when it holds more than ``need``
    tokens: growing prefixes cut at a space or line break, so the ids used are those of the whole text
    (tokenizing a many-MB file for a few hundred tokens took seconds)."""
    def encode(t: str) -> list[int]:
        return tokenizer.encode(t, add_special_tokens=False) if hasattr(tokenizer, "encode") else list(tokenizer(t))

    chars = max(4096, 16 * need)
    while chars < len(text):
        cut = max(text.rfind(" ", 0, chars), text.rfind("\n", 0, chars))
        ids = encode(text[: cut if cut > 0 else chars])
        if len(ids) >= need + 16:  # a margin: the last word before the cut may tokenize differently
            return ids
        chars *= 4
    return encode(text)


def attention_summary_from_text(model: torch.nn.Module, tokenizer: Any, text: str, *, seq_len: int = 128,
                                n_seqs: int = 4, local_window: int = 8) -> dict[str, Any]:
    """:func:`attention_summary` on ``n_seqs`` consecutive ``seq_len``-token chunks of ``text``."""
    import torch

    n_pos = getattr(getattr(model, "config", None), "n_positions", None)
    if n_pos is not None:
        seq_len = min(seq_len, int(n_pos))
    ids = _leading_ids(tokenizer, text, n_seqs * seq_len)
    n = min(n_seqs, len(ids) // seq_len)
    if n < 1:
        raise ValueError(f"text too short: {len(ids)} tokens for one sequence of {seq_len}")
    batch = torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)
    return attention_summary(model, batch, local_window=local_window)


def write_json(summary: Mapping[str, Any], path: str | Path) -> Path:
    """Write ``summary`` as JSON atomically (temp file then ``os.replace``; the umask's permissions)."""
    return atomic_write_json(path, summary)


def _draw(ax: Any, summary: Mapping[str, Any], label: str, color: str) -> None:
    for row in summary["layers"]:
        ax.scatter([row["layer"]] * row["n_heads"], row["distance"], s=12, alpha=0.5, color=color)
    _draw_means(ax, summary, f"{label} (layer mean)", color)
    _draw_plain(ax, summary)


def _draw_means(ax: Any, summary: Mapping[str, Any], label: str, color: str) -> None:
    ax.plot([r["layer"] for r in summary["layers"]], summary["mean_distance"], "-o", color=color, label=label)
    ax.set_xlabel("layer")
    ax.grid(alpha=0.3)


def _draw_plain(ax: Any, summary: Mapping[str, Any]) -> None:
    """The distance of a plain average over the prefix, dashed (older summaries have none)."""
    if (plain := summary.get("plain_average_distance")) is not None:
        ax.axhline(plain, ls="--", color="gray", lw=1, label="plain average over the prefix")


def plot_distance(summary: Mapping[str, Any], path: str | Path, title: str | None = None) -> Path:
    """PNG of mean attention distance per layer: one dot per head, the line is the layer mean."""
    fig, ax = new_figure(figsize=(6, 4))
    _draw(ax, summary, "heads", "C0")
    ax.set_ylabel("mean attention distance (tokens)")
    ax.set_title(title or f"attention distance ({summary['n_sequences']}x{summary['n_tokens']} tokens)")
    ax.legend()
    return save_figure(fig, path)


def plot_distance_comparison(summaries: Mapping[str, Mapping[str, Any]], path: str | Path,
                             title: str | None = None) -> Path:
    """PNG with one panel per model (heads as dots, layer means as a line, shared y axis) and a last
    panel overlaying every model's layer means: ``{"uniform": s1, "prism": s2}``."""
    if not summaries:
        raise ValueError("plot_distance_comparison needs at least one summary")
    n = len(summaries)
    fig, axes = new_figure(1, n + 1, figsize=(4 * (n + 1), 4), sharey=True)
    for k, (name, s) in enumerate(summaries.items()):
        _draw(axes[k], s, name, f"C{k}")
        axes[k].set_title(name)
        _draw_means(axes[n], s, name, f"C{k}")
    _draw_plain(axes[n], next(iter(summaries.values())))  # one text and seq_len: one mark for the overlay
    axes[0].set_ylabel("mean attention distance (tokens)")
    axes[n].set_title("layer means")
    axes[n].legend()
    if title:
        fig.suptitle(title)
    return save_figure(fig, path)
