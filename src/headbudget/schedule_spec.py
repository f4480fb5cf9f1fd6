"""Schedule specs: the names a schedule is given on the command line and in configs, read into a
:class:`~headbudget.schedules.HeadSchedule` for a preset.  This module sits above :mod:`headbudget.schedules`
and :mod:`headbudget.budget` (neither imports it), so the spec parser has one home and no import circle.

    >>> schedule_from_spec("uniform@128", "cpu-small").heads
    (2, 2, 2, 2, 2, 2)
    >>> schedule_from_spec("uniform_shrink:0.5", "cpu-tiny").head_dims
    (16, 16, 16, 16)
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from headbudget.budget import STRATEGIES, budgeted_schedule, fit_integer_total, parse_budget_spec
from headbudget.schedules import (
    HeadSchedule,
    LayerSpec,
    ModelPreset,
    ScheduleError,
    from_list,
    get_preset,
    linear,
    prism,
    reverse,
    uniform,
    uniform_head_dim,
)

# Kinds of schedule a user can name: ``fn(preset, **options)``; ``register_schedule_kind`` adds more.
ScheduleFactory = Callable[..., HeadSchedule]
SCHEDULE_KINDS: dict[str, ScheduleFactory] = {}


def register_schedule_kind(name: str) -> Callable[[ScheduleFactory], ScheduleFactory]:
    """Decorator: make ``fn(preset, **options) -> HeadSchedule`` a kind ``schedule_from_spec`` knows.

    >>> @register_schedule_kind("first_layer_wide")
    ... def _wide(p, **_):
    ...     return from_list([1] + [p.n_heads] * (p.n_layers - 1), p.d_model)
    >>> schedule_from_spec("first_layer_wide", "cpu-tiny").heads
    (1, 4, 4, 4)
    >>> del SCHEDULE_KINDS["first_layer_wide"]
    """

    def deco(fn: ScheduleFactory) -> ScheduleFactory:
        SCHEDULE_KINDS[name] = fn
        return fn

    return deco


@register_schedule_kind("uniform")
def _kind_uniform(p: ModelPreset, **_: Any) -> HeadSchedule:
    return uniform(p.n_layers, p.d_model, p.n_heads)


@register_schedule_kind("prism")
def _kind_prism(p: ModelPreset, max_head_dim: int | None = None, min_head_dim: int | None = None,
                **_: Any) -> HeadSchedule:
    return prism(p.n_layers, p.d_model, max_head_dim or p.prism_max_head_dim,
                 min_head_dim or p.prism_min_head_dim)


@register_schedule_kind("reverse")
def _kind_reverse(p: ModelPreset, max_head_dim: int | None = None, min_head_dim: int | None = None,
                  **_: Any) -> HeadSchedule:
    return reverse(p.n_layers, p.d_model, max_head_dim or p.prism_max_head_dim,
                   min_head_dim or p.prism_min_head_dim)


@register_schedule_kind("linear")
def _kind_linear(p: ModelPreset, max_head_dim: int | None = None, min_head_dim: int | None = None,
                 **_: Any) -> HeadSchedule:
    lo = p.d_model // (max_head_dim or p.prism_max_head_dim)
    hi = p.d_model // (min_head_dim or p.prism_min_head_dim)
    return linear(p.n_layers, p.d_model, max(1, lo), hi)


def _budget_kind(strategy: str) -> ScheduleFactory:
    """The kind ``strategy`` (``uniform_shrink``, ...): ``budget=`` or ``spec_arg="0.75[:OPT=VAL]"``."""

    def factory(p: ModelPreset, budget: float | None = None, spec_arg: str | None = None,
                **options: Any) -> HeadSchedule:
        known = {k: v for k, v in options.items() if any(k in names for _, names in STRATEGIES.values())}
        if spec_arg:
            _, fraction, opts = parse_budget_spec(f"{strategy}:{spec_arg}")
            known.update(opts)
            budget = fraction if fraction is not None else budget
        if budget is None and strategy != "custom":
            budget = 0.75
        return budgeted_schedule(p, budget, strategy, **known)

    factory.__name__ = f"_kind_{strategy}"
    factory.__doc__ = f"Registered schedule kind {strategy!r}: budgeted_schedule(p, budget, {strategy!r})."
    return factory


for _strategy in STRATEGIES:
    register_schedule_kind(_strategy)(_budget_kind(_strategy))


def schedule_from_spec(spec: str, preset: ModelPreset | str, **options: Any) -> HeadSchedule:
    """Build a schedule from its command-line name for a preset: a registered kind (``uniform``, ``prism``,
    ...), ``uniform@HEAD_DIM``, a comma list of head counts, the budget form ``KIND:FRACTION[:OPT=VAL]``, or
    ``from:DIR[:neutral]`` (a saved model's layout, :func:`schedule_from_model`).

    >>> schedule_from_spec("late_dim_decay:0.5:decay=geometric:keep=2", "cpu-small").head_dims
    (64, 64, 32, 16, 8, 8)
    """
    p = get_preset(preset) if isinstance(preset, str) else preset
    spec = spec.strip()
    if spec.startswith("from:"):
        path, _, mode = spec[len("from:"):].partition(":")
        if mode not in ("", "neutral"):
            raise ScheduleError(f"bad schedule {spec!r}: expected from:DIR or from:DIR:neutral")
        sched = schedule_from_model(path, neutral=mode == "neutral")
        if sched.d_model != p.d_model or sched.n_layers != p.n_layers:
            raise ScheduleError(f"{path}: its schedule is {sched.n_layers} layers x d_model {sched.d_model}, "
                                f"preset {p.name} is {p.n_layers} x {p.d_model}")
        return sched
    if ":" in spec:  # parse_budget_spec names an unknown strategy
        kind, fraction, opts = parse_budget_spec(spec)
        sched = budgeted_schedule(p, fraction, kind, **{**options, **opts})
    elif spec in SCHEDULE_KINDS:
        sched = SCHEDULE_KINDS[spec](p, **options)
    elif spec.startswith("uniform@"):
        try:
            dim = int(spec.split("@", 1)[1])
        except ValueError:
            raise ScheduleError(f"bad schedule {spec!r}: expected uniform@HEAD_DIM, e.g. uniform@128") from None
        sched = uniform_head_dim(p.n_layers, p.d_model, dim)
    elif "," in spec or spec.isdigit():
        sched = from_list(spec, p.d_model, p.n_layers)
    else:
        raise ScheduleError(f"unknown schedule {spec!r}; use one of {', '.join(SCHEDULE_KINDS)}, "
                            "uniform@HEAD_DIM, or a comma list of head counts")
    if sched.n_layers != p.n_layers:
        raise ScheduleError(f"schedule has {sched.n_layers} layers but preset {p.name} has {p.n_layers}")
    return sched


def schedule_from_model(directory: str, neutral: bool = False) -> HeadSchedule:
    """The schedule a saved headbudget model has (heads kept per layer, kv groups, widths).

    ``neutral=True`` keeps the head and kv-head counts but re-widens the heads to one shared head_dim (as
    far as the multiple allows) so that D = sum(heads x head_dim) equals the dense model's again
    (``dense_budget``, recorded at the first pruning; else layers x d_model).

        >>> schedule_from_model("runs/pruned/model").heads          # doctest: +SKIP
        (2, 3, 3, 5, 6, 6)
    """
    cfg_path = Path(directory) / "config.json"
    if not cfg_path.is_file() and (Path(directory) / "model" / "config.json").is_file():
        cfg_path = Path(directory) / "model" / "config.json"  # a run folder
    try:
        raw = json.loads(cfg_path.read_text())
    except FileNotFoundError:
        raise ScheduleError(f"{directory}: no config.json (from:DIR needs a saved headbudget model)") from None
    except json.JSONDecodeError as exc:
        raise ScheduleError(f"{cfg_path}: not valid JSON ({exc.msg}, line {exc.lineno})") from None
    if "schedule" not in raw:
        raise ScheduleError(f"{cfg_path}: model_type {raw.get('model_type')!r} has no headbudget schedule "
                            "(convert and save it with headbudget first, e.g. headbudget prune)")
    sched = HeadSchedule.from_dict(dict(raw["schedule"], head_dim_multiple=1, neutral=False))
    dense = int(raw["schedule"].get("dense_budget", sched.n_layers * sched.d_model))
    if not neutral:
        return replace(sched, name=f"from:{directory}")
    multiple = int(raw["schedule"].get("head_dim_multiple", 8))
    heads = [s.n_heads for s in sched.layers]
    unit = dense / (sum(heads) * multiple)  # one shared head_dim, in units of the multiple
    units = fit_integer_total([unit] * len(heads), [1] * len(heads), [10 ** 6] * len(heads),
                              [h * multiple for h in heads], dense)
    layers = [LayerSpec(s.n_heads, u * multiple, s.n_kv_heads, kv_groups=s.kv_groups)
              for s, u in zip(sched.layers, units)]
    return HeadSchedule(sched.d_model, tuple(layers), neutral=False, head_dim_multiple=multiple,
                        name=f"from:{directory}:neutral")
