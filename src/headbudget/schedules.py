"""Head schedules: how attention is split into heads in every layer.

A :class:`HeadSchedule` is an immutable list of :class:`LayerSpec` (one per layer) plus ``d_model``.  A
*neutral* schedule has ``n_heads * head_dim == d_model`` in every layer, so its weights have the shapes of the
uniform model (identical parameters and FLOPs); a budgeted or pruned one may be narrower.  Command-line
names (``prism``, ``uniform@128``, ...) are read by :func:`headbudget.schedule_spec.schedule_from_spec`.

    >>> from headbudget.schedules import prism
    >>> prism(12, 768).heads
    (3, 3, 3, 3, 6, 6, 6, 6, 12, 12, 12, 12)
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any


class ScheduleError(ValueError):
    """An invalid schedule; the message names the layer and the offending value."""


@dataclass(frozen=True)
class LayerSpec:
    """One layer's attention.

    ``head_dim`` is the nominal head width: it sets the softmax scale ``1/sqrt(head_dim)`` and the
    default widths of the query/key (``qk_head_dim``) and value (``v_head_dim``) projections per head.
    Low-rank compression shrinks ``qk_head_dim``/``v_head_dim`` while keeping the scale of the original.
    """

    n_heads: int
    head_dim: int
    n_kv_heads: int | None = None
    qk_head_dim: int | None = None
    v_head_dim: int | None = None
    kv_groups: tuple[int, ...] | None = None  # query heads per kv head, only when unequal (after pruning)

    def __post_init__(self) -> None:
        if self.kv_groups is not None:
            groups = tuple(int(g) for g in self.kv_groups)
            object.__setattr__(self, "kv_groups", None if len(set(groups)) == 1 else groups)
            if self.n_kv_heads is None:
                object.__setattr__(self, "n_kv_heads", len(groups))
        for name, default in {"n_kv_heads": self.n_heads, "qk_head_dim": self.head_dim,
                              "v_head_dim": self.head_dim}.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)

    @property
    def width(self) -> int:
        """Attention width n_heads x head_dim (this layer's share of the budget D)."""
        return self.n_heads * self.head_dim

    @property
    def group_size(self) -> int:
        """Query heads per key/value head (1 for multi-head attention)."""
        return self.n_heads // self.n_kv_heads

    def to_dict(self) -> dict[str, int]:
        d = {"n_heads": self.n_heads, "head_dim": self.head_dim, "n_kv_heads": self.n_kv_heads}
        # only written when they differ, so ordinary schedules stay short in JSON
        d.update({k: getattr(self, k) for k in ("qk_head_dim", "v_head_dim")
                  if getattr(self, k) != self.head_dim})
        if self.kv_groups is not None:
            d["kv_groups"] = list(self.kv_groups)
        return d


@dataclass(frozen=True)
class HeadSchedule:
    """Per-layer attention layout of a model with width ``d_model``.

    ``neutral=True`` demands ``n_heads * head_dim == d_model`` in every layer (parameter- and
    FLOP-neutral schedules); budgeted and pruned schedules set it to False.  ``head_dim_multiple``
    (default 8) is the granularity head dims must respect; set it to 1 to allow any width.
    """

    d_model: int
    layers: tuple[LayerSpec, ...]
    neutral: bool = True
    head_dim_multiple: int = 8
    name: str = "custom"

    def __post_init__(self) -> None:
        layers = tuple(spec if isinstance(spec, LayerSpec) else LayerSpec(**spec) for spec in self.layers)
        object.__setattr__(self, "layers", layers)
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.d_model, int) or self.d_model <= 0:
            raise ScheduleError(f"d_model must be a positive integer, got {self.d_model!r}")
        if self.head_dim_multiple <= 0:
            raise ScheduleError(f"head_dim_multiple must be positive, got {self.head_dim_multiple}")
        if not self.layers:
            raise ScheduleError("a schedule needs at least one layer")
        for i, s in enumerate(self.layers):
            for name in ("n_heads", "head_dim", "n_kv_heads", "qk_head_dim", "v_head_dim"):
                value = getattr(s, name)
                if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                    raise ScheduleError(f"layer {i}: {name} must be a positive integer, got {value!r}")
            if s.kv_groups is not None:
                if len(s.kv_groups) != s.n_kv_heads or sum(s.kv_groups) != s.n_heads or min(s.kv_groups) < 1:
                    raise ScheduleError(f"layer {i}: kv_groups {list(s.kv_groups)} must list {s.n_kv_heads} "
                                        f"positive sizes summing to n_heads={s.n_heads}")
            elif s.n_heads % s.n_kv_heads:
                raise ScheduleError(f"layer {i}: n_heads={s.n_heads} is not divisible by "
                                    f"n_kv_heads={s.n_kv_heads}")
            if s.head_dim % self.head_dim_multiple:
                raise ScheduleError(f"layer {i}: head_dim={s.head_dim} is not a multiple of "
                                    f"{self.head_dim_multiple} (set head_dim_multiple=1 to allow it)")
            if self.neutral and s.width != self.d_model:
                raise ScheduleError(f"layer {i}: n_heads x head_dim = {s.n_heads} x {s.head_dim} = {s.width} "
                                    f"!= d_model={self.d_model} in a parameter-neutral schedule")

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def heads(self) -> tuple[int, ...]:
        return tuple(s.n_heads for s in self.layers)

    @property
    def head_dims(self) -> tuple[int, ...]:
        return tuple(s.head_dim for s in self.layers)

    @property
    def kv_heads(self) -> tuple[int, ...]:
        return tuple(s.n_kv_heads for s in self.layers)

    @property
    def budget(self) -> int:
        """D = sum over layers of n_heads x head_dim."""
        return sum(s.width for s in self.layers)

    @property
    def total_heads(self) -> int:
        return sum(self.heads)

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i: int) -> LayerSpec:
        return self.layers[i]

    def __iter__(self):
        return iter(self.layers)

    # ------------------------------------------------------------------ edits (return new schedules)
    def with_layers(self, layers: Iterable[LayerSpec], *, neutral: bool | None = None,
                    name: str | None = None) -> HeadSchedule:
        return replace(self, layers=tuple(layers), neutral=self.neutral if neutral is None else neutral,
                       name=self.name if name is None else name)

    def with_layer(self, index: int, spec: LayerSpec, *, neutral: bool | None = None) -> HeadSchedule:
        layers = list(self.layers)
        layers[index] = spec
        return self.with_layers(layers, neutral=neutral)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "d_model": self.d_model, "neutral": self.neutral,
                "head_dim_multiple": self.head_dim_multiple, "layers": [s.to_dict() for s in self.layers]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HeadSchedule:
        try:
            layers = tuple(LayerSpec(**spec) for spec in d["layers"])
            return cls(d_model=d["d_model"], layers=layers, neutral=d.get("neutral", True),
                       head_dim_multiple=d.get("head_dim_multiple", 8), name=d.get("name", "custom"))
        except KeyError as exc:
            raise ScheduleError(f"schedule dict is missing the field {exc.args[0]!r}") from None
        except TypeError as exc:
            raise ScheduleError(f"bad schedule dict: {exc}") from None

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_json(cls, text: str) -> HeadSchedule:
        return cls.from_dict(json.loads(text))

    def describe(self) -> str:
        """Compact one-line form, e.g. ``prism 3x256,3x256,...``."""
        return f"{self.name}: " + ",".join(str(h) for h in self.heads)


# ---------------------------------------------------------------------- generators
def _check_positive(**kw: int) -> None:
    for k, v in kw.items():
        if not isinstance(v, int) or v <= 0:
            raise ScheduleError(f"{k} must be a positive integer, got {v!r}")


def uniform(n_layers: int, d_model: int, n_heads: int, n_kv_heads: int | None = None) -> HeadSchedule:
    """Every layer splits d_model into ``n_heads`` equal heads (the standard Transformer).

    >>> uniform(12, 768, 12).heads[:2]
    (12, 12)
    """
    _check_positive(n_layers=n_layers, d_model=d_model, n_heads=n_heads)
    if d_model % n_heads:
        raise ScheduleError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
    spec = LayerSpec(n_heads, d_model // n_heads, n_kv_heads)
    return HeadSchedule(d_model, (spec,) * n_layers, name="uniform")


def uniform_head_dim(n_layers: int, d_model: int, head_dim: int) -> HeadSchedule:
    """Uniform schedule with a given head width (``uniform@128``): the wide-head control for prism."""
    _check_positive(head_dim=head_dim)
    if d_model % head_dim:
        raise ScheduleError(f"d_model={d_model} is not divisible by head_dim={head_dim}")
    return replace(uniform(n_layers, d_model, d_model // head_dim), name=f"uniform@{head_dim}")


def _stage_sizes(n_layers: int, n_stages: int) -> list[int]:
    """Split n_layers into n_stages contiguous stages as evenly as possible, extras to later stages."""
    base, extra = divmod(n_layers, n_stages)
    return [base + (1 if i >= n_stages - extra else 0) for i in range(n_stages)]


def _power_of_two_dims(max_head_dim: int, min_head_dim: int) -> list[int]:
    for name, v in (("max_head_dim", max_head_dim), ("min_head_dim", min_head_dim)):
        if not isinstance(v, int) or v <= 0 or v & (v - 1):
            raise ScheduleError(f"{name} must be a positive power of two, got {v!r}")
    if min_head_dim > max_head_dim:
        raise ScheduleError(f"min_head_dim={min_head_dim} is larger than max_head_dim={max_head_dim}")
    return [max_head_dim >> i for i in range((max_head_dim // min_head_dim).bit_length())]


def prism(n_layers: int, d_model: int, max_head_dim: int = 256, min_head_dim: int = 64,
          n_kv_groups: int | None = None) -> HeadSchedule:
    """The progressive ("Prism") schedule: few wide heads early, many narrow heads late.

    Head dims are the powers of two from ``max_head_dim`` down to ``min_head_dim``, one contiguous stage each,
    stages as even as possible (extra layers go to the later stages), every layer neutral.  ``n_kv_groups``
    gives every layer ``n_heads // n_kv_groups`` key/value heads (grouped-query attention).

    >>> prism(12, 768).heads
    (3, 3, 3, 3, 6, 6, 6, 6, 12, 12, 12, 12)
    """
    _check_positive(n_layers=n_layers, d_model=d_model)
    dims = _power_of_two_dims(max_head_dim, min_head_dim)
    if len(dims) > n_layers:
        raise ScheduleError(f"prism needs at least one layer per head dim ({dims}), but the model has "
                            f"{n_layers} layers")
    layers = []
    for dim, size in zip(dims, _stage_sizes(n_layers, len(dims))):
        if d_model % dim:
            raise ScheduleError(f"d_model={d_model} is not divisible by prism head_dim={dim}")
        n_heads = d_model // dim
        n_kv = None if n_kv_groups is None else max(1, n_heads // n_kv_groups)
        layers += [LayerSpec(n_heads, dim, n_kv)] * size
    return HeadSchedule(d_model, tuple(layers), name="prism")


def reverse(n_layers: int, d_model: int, max_head_dim: int = 256, min_head_dim: int = 64) -> HeadSchedule:
    """Prism's stages in the opposite order (many narrow heads early): the ablation."""
    p = prism(n_layers, d_model, max_head_dim, min_head_dim)
    # Reverse the stage order but keep stage sizes growing with depth, as prism does.
    dims = _power_of_two_dims(max_head_dim, min_head_dim)[::-1]
    layers = []
    for dim, size in zip(dims, _stage_sizes(n_layers, len(dims))):
        layers += [LayerSpec(d_model // dim, dim)] * size
    return replace(p, layers=tuple(layers), name="reverse")


def linear(n_layers: int, d_model: int, min_heads: int, max_heads: int) -> HeadSchedule:
    """Head counts growing linearly from ``min_heads`` to ``max_heads``, each rounded to the nearest
    valid divisor of d_model (head_dim a multiple of 8).

    >>> linear(4, 256, 1, 4).heads
    (1, 2, 2, 4)
    """
    _check_positive(n_layers=n_layers, d_model=d_model, min_heads=min_heads, max_heads=max_heads)
    valid = [h for h in range(1, d_model + 1) if d_model % h == 0 and (d_model // h) % 8 == 0]
    if not valid:
        raise ScheduleError(f"d_model={d_model} has no head count with head_dim a multiple of 8")
    targets = [min_heads + (max_heads - min_heads) * (i / max(1, n_layers - 1)) for i in range(n_layers)]
    heads = [min(valid, key=lambda v: (abs(v - t), v)) for t in targets]
    return HeadSchedule(d_model, tuple(LayerSpec(h, d_model // h) for h in heads), name="linear")


def from_list(heads: str | Sequence[int], d_model: int, n_layers: int | None = None) -> HeadSchedule:
    """A neutral schedule from per-layer head counts, e.g. ``from_list("3,3,6,6,12,12", 768)``."""
    if isinstance(heads, str):
        try:
            counts = [int(x) for x in heads.split(",") if x.strip()]
        except ValueError:
            raise ScheduleError(f"head list {heads!r} is not a comma list of integers") from None
    else:
        counts = list(heads)
    if n_layers is not None and len(counts) != n_layers:
        raise ScheduleError(f"head list has {len(counts)} entries but the model has {n_layers} layers")
    layers = []
    for i, h in enumerate(counts):
        if not isinstance(h, int) or h <= 0:
            raise ScheduleError(f"layer {i}: n_heads must be a positive integer, got {h!r}")
        if d_model % h:
            raise ScheduleError(f"layer {i}: d_model={d_model} is not divisible by n_heads={h}")
        layers.append(LayerSpec(h, d_model // h))
    return HeadSchedule(d_model, tuple(layers), name="list")


# ---------------------------------------------------------------------- presets
@dataclass(frozen=True)
class ModelPreset:
    """Shape of a model family member; the schedule is chosen separately."""

    name: str
    n_layers: int
    d_model: int
    n_heads: int
    n_positions: int
    vocab_size: int
    prism_max_head_dim: int = 256
    prism_min_head_dim: int = 64

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset("gpt2-124m", 12, 768, 12, 1024, 50257),
        ModelPreset("gpt2-354m", 24, 1024, 16, 1024, 50257),
        ModelPreset("gpt-757m", 24, 1536, 16, 1024, 50257),
        # CPU presets: a training step (batch 8 x context) well under a second on 2 cores.
        ModelPreset("cpu-tiny", 4, 128, 4, 128, 512, prism_max_head_dim=128, prism_min_head_dim=32),
        ModelPreset("cpu-small", 6, 256, 4, 256, 2048, prism_max_head_dim=256, prism_min_head_dim=64),
        # cpu-tiny twice as deep: the Prism study's second size (docs/prism_study.md, size fallback).
        ModelPreset("cpu-mid", 8, 128, 4, 128, 512, prism_max_head_dim=128, prism_min_head_dim=32),
    )
}


def get_preset(name: str) -> ModelPreset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ScheduleError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}") from None
