"""The pruning methods ``prune`` / ``prune-compare`` know: a registry any user can add a method to.

A method is a plug-in registered under a name (as Torch-Pruning's ``Importance``): an **importance**
``fn(ctx: ImportanceContext) -> list[np.ndarray]`` (one score array per layer, higher = more important;
the pipeline keeps the best heads, :func:`headbudget.pruning.importance.select_top`) or a **selector**
``fn(run: MethodRun) -> Selection`` that chooses the kept heads itself (``finds_count=True``: it may also
choose how many).  Every built-in registers here; all but ``cahp`` follow the job's ``layer_floor``.
Installed packages add methods through the entry-point group :data:`ENTRY_POINT_GROUP` (:func:`load_plugins`).
See docs/pruning.md, "Adding a method".

    >>> import numpy as np
    >>> from headbudget.pruning.methods import available_importances, register_importance, unregister
    >>> @register_importance("last-heads")
    ... def last_heads(ctx):
    ...     return [np.arange(n, dtype=float) for n in ctx.head_counts]   # the last head of a layer scores highest
    >>> available_importances()[-1]
    'last-heads'
    >>> unregister("last-heads")
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from headbudget.pruning import attattr, cahp, gated, workloads
from headbudget.pruning import report as rpt
from headbudget.pruning.importance import (
    Batch,
    Importance,
    ImportanceContext,
    fisher_importance,
    flatten,
    gate_mask,
    magnitude_importance,
    michel_importance,
    michel_iterative,
    random_importance,
    select_top,
)
from headbudget.pruning.job import (
    ENTRY_POINT_GROUP,
    AttAttrSettings,
    CahpSettings,
    DspPassSettings,
    PruneCompareJob,
    join_settings,
)

if TYPE_CHECKING:
    from headbudget.models.surgery import HeadAdapter

__all__ = ["MethodRun", "PruningMethod", "Selection", "UnknownMethodError", "available_importances",
           "get_importance", "importance_table", "load_plugins", "register_importance", "register_selector",
           "score_heads", "select_by_method", "unregister"]


class UnknownMethodError(ValueError):
    """A method name nobody registered (a one-line error listing the registered names)."""


@dataclass
class MethodRun:
    """What a selector sees of one :func:`~headbudget.pruning.pipeline.run_prune` call."""

    job: Any                       # the PruneJob
    workload: Any                  # its loaded Workload (model, tokenizer, data, evaluation)
    adapter: HeadAdapter                   # the model's head adapter (gates, attention maps, head removal)
    model: torch.nn.Module
    target: int | None             # heads to keep; None only for a finds_count method without a forced count
    out: Path                      # the run's output folder (plots go there)
    signature_batches: Sequence[Batch]
    importance_batches: Sequence[Batch]
    head_counts: list[int] = field(init=False)  # heads per layer before any is removed

    def __post_init__(self) -> None:
        self.head_counts = list(self.adapter.head_counts())

    @property
    def heads(self) -> list[tuple[int, int]]:
        """``[(layer, head), ...]`` before any head is removed: the flat order of kept indices and scores."""
        return [(layer, h) for layer, n in enumerate(self.head_counts) for h in range(n)]

    def importance_context(self) -> ImportanceContext:
        """The context an importance gets: the first ``job.importance_batches`` shuffled training batches."""
        return ImportanceContext(self.adapter, self.model, self.importance_batches[: self.job.importance_batches],
                                 seed=self.job.seed, progress=self.job.progress, job=self.job)


@dataclass
class Selection:
    """A method's decision: ``kept`` flat head indices, what goes into ``details.json`` (``scores``: one final
    score per head, ranking heads for ``granularity``), stage timings (their sum is ``select``'s time when
    given), CAHP's knee and curve for the report, and the plots written."""

    kept: list[int]
    details: dict[str, Any] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    knee_k: int | None = None
    mss: list[tuple[int, float]] = field(default_factory=list)
    plots: list[str] = field(default_factory=list)


Selector = Callable[[MethodRun], Selection]
KeepHeads = Callable[[ImportanceContext, int, bool], list[int]]


@dataclass(frozen=True)
class PruningMethod:
    """One registered method.  ``select`` runs the ``selector`` when there is one (a selector may also carry
    the ``importance`` it is built from), else ``keep_heads`` (an importance that picks its heads itself, as
    ``michel``'s rounds do), else keeps the top ``importance`` scores.

    ``settings``: the dataclass of the method's own job fields (:func:`with_method_settings`); ``job_fields``:
    the job fields only it reads (a resumed comparison reruns it when they change; default: ``settings``'
    fields); ``check(job)`` raises a one-line ``ValueError`` for a job it cannot run; ``keeps_layer_floor``:
    it always keeps a head per layer (a job with ``layer_floor`` off is refused for it)."""

    name: str
    importance: Importance | None = None
    selector: Selector | None = None
    keep_heads: KeepHeads | None = None
    finds_count: bool = False
    job_fields: tuple[str, ...] | None = None
    check: Callable[[Any], None] | None = None
    keeps_layer_floor: bool = False
    settings: type | None = None

    def __post_init__(self) -> None:
        own = dataclasses.fields(self.settings) if dataclasses.is_dataclass(self.settings) else ()
        if self.settings is not None and (not dataclasses.is_dataclass(self.settings) or any(
                f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING for f in own)):
            raise TypeError(f"method {self.name!r}: settings must be a dataclass whose fields all have "
                            f"defaults, got {self.settings!r}")
        object.__setattr__(self, "job_fields", tuple(f.name for f in own) if self.job_fields is None
                           else tuple(self.job_fields))

    def select(self, run: MethodRun) -> Selection:
        floor = self.keeps_layer_floor or layer_floor_of(run.job)
        if self.selector is not None:
            sel = self.selector(run)
        elif self.keep_heads is not None:
            sel = Selection(kept=self.keep_heads(run.importance_context(), run.target, floor))
        else:
            scores = [np.asarray(s, dtype=np.float64).reshape(-1) for s in self.importance(run.importance_context())]
            if [len(s) for s in scores] != run.head_counts:
                raise ValueError(f"importance {self.name!r} returned {[len(s) for s in scores]} scores per layer; "
                                 f"the model has {run.head_counts} heads per layer")
            sel = Selection(kept=select_top(scores, run.target, layer_floor=floor), details={"scores": flatten(scores)})
        sel.kept = _checked_kept(self.name, sel.kept, run.head_counts, floor)
        return sel


def layer_floor_of(job: Any) -> bool:
    """Whether ``job`` keeps at least one head per layer (a job object without the setting: yes, as before it)."""
    return bool(getattr(job, "layer_floor", True))


def _checked_kept(name: str, kept: Sequence[int], counts: Sequence[int], layer_floor: bool = True) -> list[int]:
    """``kept`` sorted, or a one-line ``ValueError`` when a selector's heads cannot be the pruned model's."""
    total = sum(counts)
    out = sorted(int(i) for i in kept)
    if len(set(out)) != len(out) or (out and not 0 <= out[0] <= out[-1] < total):
        raise ValueError(f"method {name!r} kept heads {out}: give distinct flat indices in 0..{total - 1}")
    layer_of = [layer for layer, n in enumerate(counts) for _ in range(n)]
    empty = sorted(set(range(len(counts))) - {layer_of[i] for i in out})
    if not out:
        raise ValueError(f"method {name!r} kept no head at all")
    if empty and layer_floor:
        raise ValueError(f"method {name!r} kept no head of layer {empty[0]}: every layer keeps at least one")
    return out


_REGISTRY: dict[str, PruningMethod] = {}


def _register(method: PruningMethod, replace: bool) -> None:
    name = method.name
    if not isinstance(name, str) or not name or any(c in name for c in ",@ ") or name != name.strip():
        raise ValueError(f"method name {name!r}: give a non-empty name without ',', '@' or spaces "
                         "(prune-compare's --methods list uses them)")
    if name in _REGISTRY and not replace:
        raise ValueError(f"pruning method {name!r} is already registered (replace=True overrides it)")
    if method.settings is not None:  # a clash refused here (a plug-in: one warning), not when the CLI is built
        join_settings(PruneCompareJob, [m.settings for n, m in _REGISTRY.items()  # PruneJob's fields with it
                                        if m.settings is not None and n != name] + [method.settings])
    _REGISTRY[name] = method


def _adder(register: str, role: str, name: str, fn: Any, replace: bool, settings: type | None,
           **kw: Any) -> Any:
    """The body of ``register``: ``fn`` (as a decorator, the function it gets) registered as the ``role`` of
    method ``name``, with ``settings`` or else ``fn.settings``; a class registers one instance of itself."""
    def add(f: Any) -> Any:
        if not callable(f):
            raise TypeError(f"{register}({name!r}): {f!r} is not callable")
        _register(PruningMethod(name, **{role: f() if isinstance(f, type) else f},
                                settings=settings or getattr(f, "settings", None), **kw), replace)
        return f

    return add if fn is None else add(fn)


def register_importance(name: str, fn: Importance | None = None, *, replace: bool = False,
                        job_fields: Sequence[str] | None = None, check: Callable[[Any], None] | None = None,
                        keep_heads: KeepHeads | None = None, settings: type | None = None) -> Any:
    """Register ``fn(ctx) -> [scores of layer 0, scores of layer 1, ...]`` (or a class of such callables) as
    method ``name``; a decorator without ``fn``.  ``keep_heads(ctx, n_keep, layer_floor)``: the method
    picks its heads itself (iterative pruning) rather than keeping the best scores.  ``settings``: a
    dataclass of its own settings (default: ``fn.settings``), read as ``ctx.job.<field>``.  Returns ``fn``."""
    return _adder("register_importance", "importance", name, fn, replace, settings, keep_heads=keep_heads,
                  job_fields=job_fields, check=check)


def register_selector(name: str, fn: Selector | None = None, *, finds_count: bool = False, replace: bool = False,
                      job_fields: Sequence[str] | None = None, check: Callable[[Any], None] | None = None,
                      importance: Importance | None = None, keeps_layer_floor: bool = False,
                      settings: type | None = None) -> Any:
    """Register ``fn(run: MethodRun) -> Selection``, a method that picks the kept heads itself, as ``name``
    (a decorator without ``fn``).  ``finds_count``: it may get ``run.target=None`` and choose the count;
    ``importance``: one-shot scores it is built from (:func:`score_heads`); the rest as
    :class:`PruningMethod`'s."""
    return _adder("register_selector", "selector", name, fn, replace, settings, importance=importance,
                  finds_count=finds_count, job_fields=job_fields, check=check,
                  keeps_layer_floor=keeps_layer_floor)


def unregister(name: str) -> None:
    """Remove method ``name`` (e.g. a test's own); unknown names are an :class:`UnknownMethodError`."""
    get_importance(name)
    del _REGISTRY[name]


_plugins_loaded = False


def load_plugins() -> list[str]:
    """Register the importances of installed packages (:data:`ENTRY_POINT_GROUP`), once; returns their names.
    One that fails to load, or takes a name already registered, is left out with one warning line naming it."""
    global _plugins_loaded
    if _plugins_loaded:
        return []
    _plugins_loaded = True
    import sys
    from importlib.metadata import entry_points

    added = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            register_importance(ep.name, ep.load())
        except Exception as exc:  # a broken plug-in must not take the built-in methods down with it
            print(f"headbudget: warning: importance plug-in {ep.name} = {ep.value} not loaded: {exc}",
                  file=sys.stderr)
        else:
            added.append(ep.name)
    return added


def available_importances() -> tuple[str, ...]:
    """Every registered method name: built-ins first, then installed plug-ins, then in the order registered."""
    load_plugins()
    return tuple(_REGISTRY)


def get_importance(name: str) -> PruningMethod:
    """The method registered as ``name``, or a one-line :class:`UnknownMethodError` naming the registered ones."""
    if name not in _REGISTRY:
        load_plugins()
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise UnknownMethodError(f"unknown pruning method {name!r}; choose from "
                                 f"{', '.join(_REGISTRY)}") from None


class _ImportanceView(Mapping[str, Importance]):
    """The registered methods that score heads, ``{name: importance}`` (:func:`importance_table`)."""

    def __getitem__(self, name: str) -> Importance:
        if name not in _REGISTRY:
            load_plugins()
        method = _REGISTRY.get(name) if isinstance(name, str) else None
        if method is None or method.importance is None:
            raise KeyError(name)
        return method.importance

    def __iter__(self) -> Iterator[str]:
        load_plugins()
        return iter([name for name, m in _REGISTRY.items() if m.importance is not None])

    def __len__(self) -> int:
        return sum(m.importance is not None for m in _REGISTRY.values())

    def __repr__(self) -> str:
        return f"importance_table({list(self)})"


def importance_table() -> Mapping[str, Importance]:
    """``{name: importance}`` of every method with one score per head: a read-only, live registry view."""
    return _ImportanceView()


def score_heads(name: str, ctx: ImportanceContext) -> list[np.ndarray]:
    """One array of scores per layer from the registered method ``name`` (higher = more important); a one-line
    ``ValueError`` for a name that has no per-head scores (a selector such as ``cahp``) or is not registered."""
    table = importance_table()
    if name not in table:
        raise UnknownMethodError(f"unknown importance {name!r}; choose from {', '.join(table)}")
    return table[name](ctx)


def select_by_method(method: str, ctx: ImportanceContext, n_keep: int,
                     layer_floor: bool = True) -> tuple[list[int], np.ndarray | None]:
    """Kept flat indices and flat scores of a scoring method (``None`` for one that picks its heads itself, as
    ``michel`` does); ``layer_floor=False``: a layer may keep no head."""
    registered = _REGISTRY.get(method)
    if registered is not None and registered.keep_heads is not None:
        return registered.keep_heads(ctx, n_keep, layer_floor), None
    scores = score_heads(method, ctx)
    return select_top(scores, n_keep, layer_floor=layer_floor), flatten(scores)


def with_method_settings(cls: type) -> type:
    """``cls`` (a ``PruneJob`` class) with every registered method's settings joined in: how a plug-in's
    settings reach ``headbudget prune``."""
    return join_settings(cls, [m.settings for m in _REGISTRY.values() if m.settings is not None])


def method_job_fields() -> dict[str, tuple[str, ...]]:
    """``{method: job fields only it reads}`` for the methods that have any."""
    return {name: m.job_fields for name, m in _REGISTRY.items() if m.job_fields}


# --------------------------------------------------------------------------- built-in selectors
def _cahp_accuracy_curve(run: MethodRun) -> tuple[Callable[[list[int]], float] | None, list[int] | None]:
    """``--curve accuracy`` (classification, no forced count): the accuracy function and the head counts to
    measure; else ``(None, None)``."""
    from headbudget.pruning.finetune import evaluate_accuracy

    job, loaded, counts = run.job, run.workload, run.head_counts
    classifier = isinstance(loaded, workloads.ClassificationWorkload)
    if not (job.curve == "accuracy" and run.target is None and classifier):
        return None, None
    curve_examples = loaded.evals[loaded.primary]

    def accuracy_fn(kept: list[int]) -> float:
        with run.adapter.set_gate_values(gate_mask(kept, counts)):
            return evaluate_accuracy(run.model, loaded.tokenizer, curve_examples, 64, job.max_length, False)

    return accuracy_fn, list(range(2, sum(counts), max(1, job.curve_step)))


def _cahp(run: MethodRun) -> Selection:
    """CAHP (:func:`headbudget.pruning.cahp.cahp_select`) with the job's settings, plus its two plots."""
    job, loaded = run.job, run.workload
    accuracy_fn, accuracy_ks = _cahp_accuracy_curve(run)
    file_order = job.salience_order == "file"  # the workload cut the first salience_fraction of the examples
    sal_batches = loaded.salience_batches(job) if file_order else run.importance_batches
    settings: CahpSettings = dataclasses.replace(job, salience_fraction=1.0) if file_order else job
    sel, secs = cahp.cahp_select(run.adapter, run.signature_batches, sal_batches, settings,
                                 n_classes=loaded.n_classes, keep=run.target, seed=job.seed,
                                 accuracy_fn=accuracy_fn, accuracy_ks=accuracy_ks, progress=job.progress)
    heads = run.heads
    details = dict(knee_source=sel.knee_source, rescued=[list(heads[i]) for i in sel.rescued],
                   salience=sel.salience, clusters=sel.labels, medoids=sel.medoids,
                   embedding=sel.embedding, accuracy_curve=sel.accuracy_curve, poly_degree=job.poly_degree,
                   mss_variant=job.mss, pool_size=job.pool_size, perplexity=job.perplexity)
    k_text = rpt.describe_k(sel.knee_k, sel.knee_source, keep=job.keep, keep_ratio=job.keep_ratio)
    plots = [str(rpt.plot_mss(sel.mss, sel.knee_k, run.out / "mss.png", f"MSS ({job.mss}), {k_text}")),
             str(rpt.plot_embedding(sel.embedding, sel.labels, heads, sel.kept, run.out / "embedding.png"))]
    return Selection(kept=sel.kept, details=details, seconds=secs, knee_k=sel.knee_k, mss=sel.mss, plots=plots)


#: the gate-training methods their authors run from the pre-trained model, jointly, for ``joint_epochs``
FROM_PRETRAINED = ("joint-dsp", "pass")


def _gated(run: MethodRun) -> Selection:
    """DSP / PASS gate training (:func:`headbudget.pruning.gated.train_gates`) with the job's settings; the
    authors' joint protocols (:data:`FROM_PRETRAINED`) first put the pre-trained weights into the model."""
    job = run.job
    assert run.target is not None
    authors = job.method in FROM_PRETRAINED
    start = workloads.load_pretrained_into(job, run.workload, run.model) if authors else "model"
    settings = gated.GateSettings(lr=job.gate_lr, epochs=job.joint_epochs if authors else job.gate_epochs,
                                  cooldown=job.gate_cooldown, weight_lr=job.lr, seed=job.seed)
    res = gated.train_gates(job.method, run.adapter, run.model, run.importance_batches[: job.importance_batches],
                            run.target, settings, progress=job.progress, layer_floor=layer_floor_of(job))
    return Selection(kept=res.kept, details=dict(scores=res.logits, gate_training=dict(res.info, start=start),
                                                 gate_history=res.history))


def _attattr(run: MethodRun) -> Selection:
    """AttAttr scores on the first ``attattr_examples`` examples of the primary evaluation split."""
    job, loaded = run.job, run.workload
    assert run.target is not None and isinstance(loaded, workloads.ClassificationWorkload)
    examples = loaded.evals[loaded.primary][: job.attattr_examples]
    scores = attattr.attattr_scores(run.adapter, run.model, loaded.tokenizer, examples, steps=job.attattr_steps,
                                    max_length=job.max_length, progress=job.progress)
    return Selection(kept=select_top(scores, run.target, layer_floor=layer_floor_of(job)),
                     details=dict(scores=flatten(scores), attattr={"split": loaded.primary, "examples": len(examples),
                                                                   "steps": job.attattr_steps}))


def _floor_kept(job: Any) -> None:
    if not layer_floor_of(job):
        raise ValueError(f"method {job.method} keeps at least one head per layer, as its paper states: layer_floor "
                         "off (--no-layer-floor) is for the baselines")


def _register_builtins() -> None:
    # the order of METHODS before the registry: the CLI's choices and error messages list them so
    register_selector("cahp", _cahp, finds_count=True, check=_floor_kept, keeps_layer_floor=True,
                      settings=CahpSettings, job_fields=())  # in every method's fingerprint, as always
    register_importance("michel", michel_importance, keep_heads=michel_iterative)
    for name, fn in (("fisher", fisher_importance), ("magnitude", magnitude_importance),
                     ("random", random_importance)):
        register_importance(name, fn)
    # each gate method's fingerprint reads only the gate settings it uses (job_fields narrows
    # DspPassSettings).  The plain names are the authors' joint protocols; before they were, joint-dsp meant
    # joint-dsp-finetuned and pass meant pass-frozen (a run folder of the old meaning lacks pretrained /
    # joint_epochs in its recorded settings, so a resumed comparison reruns it)
    own, authors = ("gate_lr", "gate_epochs", "gate_cooldown"), ("gate_lr", "pretrained", "joint_epochs")
    for name, fields, check in (("pipelined-dsp", own, gated.check_job),
                                ("joint-dsp", (*authors, "gate_cooldown"), gated.check_joint_job),
                                ("joint-dsp-finetuned", own, gated.check_job),
                                ("pass", authors, gated.check_joint_job),
                                ("pass-frozen", own[:2], gated.check_job)):
        register_selector(name, _gated, job_fields=fields, check=check, settings=DspPassSettings)
    register_selector("attattr", _attattr, check=attattr.check_job, settings=AttAttrSettings)


_register_builtins()
