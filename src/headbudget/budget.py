"""Budgeted head schedules: hit a target fraction of the uniform attention budget.

The attention budget of a schedule is ``D = sum over layers of n_heads x head_dim``.  The strategies
(``uniform_shrink``, ``late_dim_decay``, ``front_loaded_heads``, ``custom``; see docs/allocation.md) shrink a
reference schedule (by default the preset's uniform one) to a fraction of its budget and return a
*non-neutral* :class:`~headbudget.schedules.HeadSchedule`.  Each respects ``head_dim_multiple`` and meets
the target within one step of its granularity (:func:`headbudget.budget_report.budget_step`).  The spec
form ``KIND:FRACTION[:OPTION=VALUE...]`` (:func:`parse_budget_spec`) is read by
:func:`headbudget.schedule_spec.schedule_from_spec`, which sits above this module.

    >>> s = budgeted_schedule("cpu-small", 0.75, "late_dim_decay")
    >>> s.head_dims, round(s.budget / (6 * 256), 3)
    ((64, 64, 56, 48, 32, 24), 0.75)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from headbudget.budget_report import budget_step
from headbudget.schedules import HeadSchedule, LayerSpec, ModelPreset, ScheduleError, get_preset, uniform

DECAYS = ("linear", "geometric")


class BudgetError(ScheduleError):
    """A budget request that cannot be met; the message names the strategy/layer/value."""


# ---------------------------------------------------------------------- integer fitting
def fit_integer_total(targets: Sequence[float], lower: Sequence[int], upper: Sequence[int],
                      weights: Sequence[float], total: float) -> list[int]:
    """Integers ``v_i`` in ``[lower_i, upper_i]`` near ``targets`` with ``sum v_i*w_i`` close to ``total``.

    Rounds the targets, then takes the best single or paired one-unit move until none helps.  Moves are
    ranked by the total's error, then the worst and the summed squared deviation from the targets, so the
    total is met by spreading the change instead of pushing one item far off.

    >>> fit_integer_total([1.5, 1.5, 1.5], [1, 1, 1], [4, 4, 4], [1, 1, 1], 5)
    [1, 2, 2]
    """
    n = len(targets)
    v = [min(max(int(round(t)), lo), hi) for t, lo, hi in zip(targets, lower, upper)]

    def score(vals: list[int]) -> tuple[float, float, float]:
        err = abs(total - sum(x * w for x, w in zip(vals, weights)))
        devs = [abs(x - t) for x, t in zip(vals, targets)]
        return round(err, 9), round(max(devs), 9), round(sum(d * d for d in devs), 9)

    moves = [((i, d),) for i in range(n) for d in (-1, 1)]
    moves += [((i, di), (j, dj)) for i in range(n) for j in range(i + 1, n) for di in (-1, 1) for dj in (-1, 1)]
    best = score(v)
    for _ in range(10_000):
        found = None
        for move in moves:
            cand = list(v)
            for i, d in move:
                cand[i] += d
            if any(not lower[i] <= cand[i] <= upper[i] for i, _ in move):
                continue
            sc = score(cand)
            if sc < best and (found is None or sc < found[0]):
                found = (sc, cand)
        if found is None:
            break
        best, v = found
    return v


def _bisect(fn: Callable[[float], float], lo: float, hi: float, target: float, iters: int = 80) -> float:
    """Solve ``fn(x) == target`` for a non-increasing ``fn`` on ``[lo, hi]``."""
    for _ in range(iters):
        mid = (lo + hi) / 2
        if fn(mid) > target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


# ---------------------------------------------------------------------- references
def reference_schedule(base: str | ModelPreset | HeadSchedule | Sequence[int]) -> HeadSchedule:
    """The schedule a budget fraction refers to: a preset (name or :class:`ModelPreset`)'s uniform schedule,
    a :class:`HeadSchedule` as is, or ``uniform(n_layers, d_model, n_heads)`` of a triple."""
    if isinstance(base, HeadSchedule):
        return base
    if isinstance(base, str):
        base = get_preset(base)
    if isinstance(base, ModelPreset):
        return uniform(base.n_layers, base.d_model, base.n_heads)
    try:
        n_layers, d_model, n_heads = (int(x) for x in base)
    except (TypeError, ValueError):
        raise BudgetError("base must be a preset name, ModelPreset, HeadSchedule or (n_layers, d_model, "
                          f"n_heads); got {base!r}") from None
    return uniform(n_layers, d_model, n_heads)


def _check_fraction(fraction: float) -> float:
    try:
        f = float(fraction)
    except (TypeError, ValueError):
        raise BudgetError(f"budget fraction must be a number in (0, 1], got {fraction!r}") from None
    if not 0 < f <= 1:
        raise BudgetError(f"budget fraction must be in (0, 1], got {fraction!r}")
    return f


def _finish(ref: HeadSchedule, layers: list[LayerSpec], name: str, target: float | None = None,
            step: int | None = None) -> HeadSchedule:
    sched = HeadSchedule(ref.d_model, tuple(layers), neutral=False, head_dim_multiple=ref.head_dim_multiple,
                         name=name)
    if target is not None and step is not None and abs(sched.budget - target) > step:
        raise BudgetError(f"{name.split(':')[0]}: cannot reach {target / ref.budget:.3f} of the budget (got "
                          f"{sched.budget / ref.budget:.3f}); head_dim cannot go below "
                          f"{ref.head_dim_multiple} and head counts below 1")
    return sched


def _dim_units(ref: HeadSchedule) -> tuple[int, list[int]]:
    """The multiple and each layer's head_dim in its units (HeadSchedule checked that they divide)."""
    return ref.head_dim_multiple, [s.head_dim // ref.head_dim_multiple for s in ref.layers]


def _shrink_dims(ref: HeadSchedule, keep: Sequence[float], target: float, fixed: Sequence[bool]) -> list[LayerSpec]:
    """Per-layer head_dim = keep_l * head_dim_l, rounded to the multiple and fitted to ``target``."""
    m, units = _dim_units(ref)
    targets = [u * k for u, k in zip(units, keep)]
    lower = [u if f else 1 for u, f in zip(units, fixed)]
    weights = [s.n_heads * m for s in ref.layers]
    v = fit_integer_total(targets, lower, units, weights, target)
    return [LayerSpec(s.n_heads, u * m, s.n_kv_heads) for s, u in zip(ref.layers, v)]


# ---------------------------------------------------------------------- strategies
def uniform_shrink(ref: HeadSchedule, fraction: float) -> HeadSchedule:
    """Every layer keeps its heads and shrinks head_dim by the same share (rounded to the multiple)."""
    f = _check_fraction(fraction)
    target = f * ref.budget
    layers = _shrink_dims(ref, [f] * ref.n_layers, target, [False] * ref.n_layers)
    return _finish(ref, layers, f"uniform_shrink:{f:g}", target, budget_step(ref, "uniform_shrink"))


def late_dim_decay(ref: HeadSchedule, fraction: float, decay: str = "linear",
                   keep_layers: int | None = None) -> HeadSchedule:
    """Keep the first ``keep_layers`` layers whole and shrink head_dim in later layers with depth.

    ``keep_layers`` defaults to ``n_layers // 3`` and is lowered automatically when the target
    cannot be reached with that many whole layers; an explicit value that cannot reach it is an error.
    """
    f = _check_fraction(fraction)
    if decay not in DECAYS:
        raise BudgetError(f"late_dim_decay: decay must be one of {', '.join(DECAYS)}, got {decay!r}")
    n = ref.n_layers
    auto = keep_layers is None
    k = n // 3 if auto else int(keep_layers)
    if not 0 <= k < n:
        raise BudgetError(f"late_dim_decay: keep_layers must be in [0, {n - 1}] for {n} layers, got {keep_layers}")
    m, units = _dim_units(ref)
    target = f * ref.budget
    min_keep = [1 / u for u in units]

    def widths(param: float, k: int) -> list[float]:
        def g(j: int) -> float:  # the keep factor of the j-th of the n - k shrunk layers
            return 1 - param * j / (n - k) if decay == "linear" else param ** j

        return [1.0 if i < k else min(1.0, max(min_keep[i], g(i - k + 1))) for i in range(n)]

    def total(keep: list[float]) -> float:
        return sum(g * s.width for g, s in zip(keep, ref.layers))

    while (reachable := total(widths(float(n) if decay == "linear" else 0.0, k))) > target + 1e-9:
        if not (auto and k > 0):
            raise BudgetError(f"late_dim_decay: fraction {f:g} is below the smallest reachable "
                              f"{reachable / ref.budget:.3f} with keep_layers={k}"
                              + (" (lower keep_layers)" if k else " (head_dim cannot go below the multiple)"))
        k -= 1
    if decay == "linear":
        # slopes above 1 push the first shrunk layers to the floor too (needed for small fractions)
        param = _bisect(lambda s: total(widths(s, k)), 0.0, float(n), target)
    else:  # keep factor r**j falls as r falls: bisect on 1 - r so the function is non-increasing
        param = 1 - _bisect(lambda x: total(widths(1 - x, k)), 0.0, 1.0, target)
    layers = _shrink_dims(ref, widths(param, k), target, [i < k for i in range(n)])
    return _finish(ref, layers, f"late_dim_decay:{f:g}:{decay}:keep={k}", target,
                   budget_step(ref, "late_dim_decay"))


def front_loaded_heads(ref: HeadSchedule, fraction: float, max_heads: int | None = None) -> HeadSchedule:
    """Fixed head_dim; head counts fall linearly with depth from layer 0's count (or ``max_heads``)."""
    f = _check_fraction(fraction)
    n = ref.n_layers
    target = f * ref.budget
    tops = [s.n_heads if max_heads is None else int(max_heads) for s in ref.layers]

    def counts(s: float) -> list[float]:
        return [max(1.0, top * (1 - s * (i / max(1, n - 1)))) for i, top in enumerate(tops)]

    def total(c: list[float]) -> float:
        return sum(h * sp.head_dim for h, sp in zip(c, ref.layers))

    s = _bisect(lambda s: total(counts(s)), 0.0, 1.0, target)
    if total(counts(1.0)) > target + 1e-9 and n > 1:
        # even the last layer at one head is not enough: let the slope pass the middle layers too
        s = _bisect(lambda s: total(counts(s)), 0.0, float(n), target)
    v = fit_integer_total(counts(s), [1] * n, tops, [sp.head_dim for sp in ref.layers], target)
    layers = [LayerSpec(h, sp.head_dim) for h, sp in zip(v, ref.layers)]
    return _finish(ref, layers, f"front_loaded_heads:{f:g}", target, budget_step(ref, "front_loaded_heads"))


def _parse_layer_list(text: str | Sequence[Any]) -> list[LayerSpec]:
    items = text.replace(",", "/").split("/") if isinstance(text, str) else list(text)
    out = []
    for i, item in enumerate(items):
        if isinstance(item, LayerSpec):
            out.append(item)
        elif isinstance(item, (tuple, list)) and len(item) == 2:
            out.append(LayerSpec(int(item[0]), int(item[1])))
        else:
            try:
                h, d = str(item).lower().split("x")
                out.append(LayerSpec(int(h), int(d)))
            except ValueError:
                raise BudgetError(f"custom layer list entry {i} ({item!r}) is not HEADSxHEAD_DIM, "
                                  "e.g. 4x64") from None
    return out


def custom_budget(ref: HeadSchedule, fraction: float | None = None, layers: str | Sequence[Any] | None = None,
                  profile: str | Sequence[float] | None = None) -> HeadSchedule:
    """A custom per-layer budget: an exact ``layers`` list, or a relative width ``profile``.

    With ``layers`` (``"4x64/4x64/2x64/2x64"``) the schedule is taken as given (and checked against
    ``fraction`` within one layer step when a fraction is given).  With ``profile`` (``"1/1/0.5/0.5"``)
    each layer's head_dim keep factor is ``c * profile_l`` (capped at 1), ``c`` chosen to hit ``fraction``.
    """
    if (layers is None) == (profile is None):
        raise BudgetError("custom budget needs exactly one of layers=HxD/HxD/... or profile=P/P/...")
    n = ref.n_layers
    if layers is not None:
        specs = _parse_layer_list(layers)
        if len(specs) != n:
            raise BudgetError(f"custom layer list has {len(specs)} entries but the model has {n} layers")
        sched = _finish(ref, specs, "custom:" + "/".join(f"{s.n_heads}x{s.head_dim}" for s in specs))
        if fraction is not None:
            f = _check_fraction(fraction)
            if abs(sched.budget - f * ref.budget) > max(s.n_heads * ref.head_dim_multiple for s in specs):
                got = sched.budget / ref.budget
                raise BudgetError(f"custom layer list has budget {sched.budget} = {got:.3f} of the "
                                  f"reference, not the requested {f:g}")
        return sched
    f = _check_fraction(1.0 if fraction is None else fraction)
    if isinstance(profile, str):
        try:
            prof = [float(x) for x in profile.replace(",", "/").split("/") if x.strip()]
        except ValueError:
            raise BudgetError(f"custom profile {profile!r} is not a /-separated list of numbers") from None
    else:
        prof = [float(x) for x in profile]
    if len(prof) != n:
        raise BudgetError(f"custom profile has {len(prof)} entries but the model has {n} layers")
    for i, p in enumerate(prof):
        if p <= 0:
            raise BudgetError(f"custom profile: layer {i} weight must be positive, got {p}")
    _, units = _dim_units(ref)
    target = f * ref.budget

    def keep(c: float) -> list[float]:
        return [min(1.0, max(1 / u, c * p)) for u, p in zip(units, prof)]

    c = -_bisect(lambda x: sum(g * s.width for g, s in zip(keep(-x), ref.layers)), -1e6, 0.0, target)
    layers_out = _shrink_dims(ref, keep(c), target, [False] * n)
    return _finish(ref, layers_out, f"custom:{f:g}:profile=" + "/".join(f"{p:g}" for p in prof), target,
                   budget_step(ref, "custom"))


def budgeted_schedule(base: str | ModelPreset | HeadSchedule | Sequence[int], budget_fraction: float | None,
                      strategy: str = "uniform_shrink", **opts: Any) -> HeadSchedule:
    """A schedule with ``budget_fraction`` of ``base``'s attention budget, allocated by ``strategy``.

    ``opts``: ``decay`` ("linear"/"geometric") and ``keep_layers`` for ``late_dim_decay``;
    ``max_heads`` for ``front_loaded_heads``; ``layers`` or ``profile`` for ``custom``.
    ``strategy`` may carry options in spec form (``"late_dim_decay:decay=geometric:keep=2"``) or be a
    bare per-layer list: ``"4x64,4x64,2x64,2x64"`` (exact layers) or ``"1,1,0.5,0.5"`` (a profile).

    >>> budgeted_schedule("cpu-small", 0.5, "front_loaded_heads").heads
    (4, 3, 2, 1, 1, 1)
    """
    ref = reference_schedule(base)
    opts = {k: v for k, v in opts.items() if v is not None}
    strategy = strategy.strip()
    if strategy.partition(":")[0] not in STRATEGIES and ("," in strategy or "/" in strategy):
        # a bare per-layer list: HxD entries are exact layers, numbers a relative width profile
        opts["layers" if "x" in strategy.lower() else "profile"] = strategy
        strategy = "custom"
    elif ":" in strategy:  # options in spec form, e.g. late_dim_decay:decay=geometric:keep=2
        strategy, _, rest = strategy.partition(":")
        opts = {**parse_budget_spec(f"{strategy}:{budget_fraction or 1}:{rest}")[2], **opts}
    build, allowed = STRATEGIES.get(strategy, (None, ()))
    if build is None:
        raise BudgetError(f"unknown budget strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")
    if bad := sorted(set(opts) - set(allowed)):
        hint = f" (it takes {', '.join(allowed)})" if allowed else " (it takes none)"
        raise BudgetError(f"strategy {strategy} does not take option(s) {', '.join(bad)}{hint}")
    if "keep_layers" in opts:
        opts["keep_layers"] = int(opts["keep_layers"])
    return build(ref, budget_fraction, **opts)


#: strategy -> (its function, the options it takes)
STRATEGIES: dict[str, tuple[Callable[..., HeadSchedule], tuple[str, ...]]] = {
    "uniform_shrink": (uniform_shrink, ()), "late_dim_decay": (late_dim_decay, ("decay", "keep_layers")),
    "front_loaded_heads": (front_loaded_heads, ("max_heads",)), "custom": (custom_budget, ("layers", "profile"))}


# ---------------------------------------------------------------------- spec parsing
_OPTION_ALIASES = {**{o: o for _, names in STRATEGIES.values() for o in names}, "keep": "keep_layers"}  # keep=2: the spec's short form


def parse_budget_spec(spec: str) -> tuple[str, float | None, dict[str, Any]]:
    """Split ``KIND:FRACTION[:OPT=VAL...]`` into ``(strategy, fraction, options)``.

    >>> parse_budget_spec("late_dim_decay:0.5:decay=geometric:keep=2")
    ('late_dim_decay', 0.5, {'decay': 'geometric', 'keep_layers': 2})
    """
    kind, _, rest = spec.strip().partition(":")
    if kind not in STRATEGIES:
        raise BudgetError(f"unknown budget strategy {kind!r} in {spec!r}; choose from {', '.join(STRATEGIES)}")
    fraction: float | None = None
    opts: dict[str, Any] = {}
    for part in filter(None, rest.split(":")):
        if "=" in part:
            key, _, value = part.partition("=")
            if key not in _OPTION_ALIASES:
                raise BudgetError(f"unknown option {key!r} in budget spec {spec!r}")
            key = _OPTION_ALIASES[key]
            opts[key] = int(value) if key in ("keep_layers", "max_heads") and value.isdigit() else value
        elif "x" in part.lower() and kind == "custom":
            opts["layers"] = part
        elif value_is_number(part) and fraction is None:
            fraction = float(part)
        elif part in DECAYS:
            opts["decay"] = part
        else:
            raise BudgetError(f"cannot read {part!r} in budget spec {spec!r} (expected a fraction or OPTION=VALUE)")
    if fraction is None and kind != "custom":
        raise BudgetError(f"budget spec {spec!r} needs a fraction, e.g. {kind}:0.75")
    return kind, fraction, opts


def value_is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
