"""The pruning methods ``prune`` / ``prune-compare`` know: a registry any user can add a method to.

Like Torch-Pruning's ``Importance``, a method is a plug-in registered under a name, in one of two forms:

* an **importance** -- ``fn(ctx: ImportanceContext) -> list[np.ndarray]``: one array of scores per layer
  (``ctx.head_counts[layer]`` long, higher = more important) from the model (``ctx.adapter``, ``ctx.model``),
  the importance batches (``ctx.batches``), the loss (``ctx.loss_fn``) and ``ctx.seed``.  The pipeline keeps
  the ``keep`` best heads (:func:`headbudget.pruning.importance.select_top`: each layer's best head first,
  then the best of the rest) and writes the scores to ``details.json``;
* a **selector** -- ``fn(run: MethodRun) -> Selection``: it chooses the kept heads itself (trained or
  clustering methods; an iterative importance registers ``keep_heads`` instead).  ``finds_count=True`` when it can also choose how many (``run.target``
  is then ``None`` unless the job forces a count; without it a method needs ``keep`` / ``keep_ratio``).

Every built-in method registers here (cahp, michel, fisher, magnitude, random, pipelined-dsp, joint-dsp[-finetuned],
pass[-frozen], attattr); all but ``cahp`` (``keeps_layer_floor``) follow the job's ``layer_floor``.  A new one is
usable by ``run_prune``, ``run_prune_compare`` and the CLI as soon as it is registered:

    >>> import numpy as np
    >>> from headbudget.pruning.methods import available_importances, register_importance, unregister
    >>> @register_importance("last-heads")
    ... def last_heads(ctx):
    ...     return [np.arange(n, dtype=float) for n in ctx.head_counts]   # the last head of a layer scores highest
    >>> available_importances()[-1]
    'last-heads'
    >>> run_prune(PruneJob("runs/ft", "sst5", "data/sst5", "runs/last", method="last-heads", keep=12))
    ...                                                                              # doctest: +SKIP
    >>> unregister("last-heads")

An installed package adds one with no import by the user: ``last-heads = "my_pruning.scores:last_heads"`` under
``[project.entry-points."headbudget.importance"]`` in its pyproject.toml, and ``headbudget prune MODEL --method
last-heads`` works (:func:`load_plugins` reads the group on the first lookup).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from headbudget.pruning import attattr, cahp, gated
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
    join_settings,
)

if TYPE_CHECKING:
    from headbudget.models.surgery import HeadAdapter

__all__ = [
    "MethodRun",
    "PruningMethod",
    "Selection",
    "UnknownMethodError",
    "available_importances",
    "get_importance",
    "importance_table",
    "load_plugins",
    "register_importance",
    "register_selector",
    "score_heads",
    "select_by_method",
    "unregister",
]


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
    """A method's decision: ``kept`` flat head indices (sorted), what goes into ``details.json``
    (``scores``: one final score per head, used to rank heads for ``granularity``), stage timings
    (``run_prune``'s ``select`` time is their sum when given, else the wall time), CAHP's knee and
    curve for the report, and the plots written."""

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
    """One registered method: an ``importance`` or a ``selector`` (at least one).  A selector may also carry the
    importance it is built from (:func:`score_heads` gives it); ``select`` runs the selector when there is one, else
    ``keep_heads`` (an importance that picks its heads itself, as ``michel``'s rounds do), else the top scores.

    ``settings``: the dataclass of this method's own settings (its fields are fields of the job, their flags
    flags of ``headbudget prune``: :func:`with_method_settings`); ``job_fields``: the job fields only this method
    reads (a resumed comparison reruns it when they change; default: every field of ``settings``);
    ``check(job)``: raises a one-line ``ValueError`` for a job this method cannot run.  ``keeps_layer_floor``:
    the method always keeps a head in every layer (a job with ``layer_floor`` off is refused for it)."""

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
        if self.settings is not None:
            if not dataclasses.is_dataclass(self.settings) or any(
                    f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                    for f in dataclasses.fields(self.settings)):
                raise TypeError(f"method {self.name!r}: settings must be a dataclass whose fields all have "
                                f"defaults, got {self.settings!r}")
        own = dataclasses.fields(self.settings) if self.settings is not None else ()
        object.__setattr__(self, "job_fields", tuple(f.name for f in own) if self.job_fields is None
                           else tuple(self.job_fields))

    def select(self, run: MethodRun) -> Selection:
        floor = self.keeps_layer_floor or layer_floor_of(run.job)
        if self.selector is not None:
            sel = self.selector(run)
        elif self.keep_heads is not None:
            sel = Selection(kept=self.keep_heads(run.importance_context(), run.target, floor))
        else:
            counts = run.head_counts
            scores = [np.asarray(s, dtype=np.float64).reshape(-1) for s in self.importance(run.importance_context())]
            if [len(s) for s in scores] != counts:
                raise ValueError(f"importance {self.name!r} returned {[len(s) for s in scores]} scores per layer; "
                                 f"the model has {counts} heads per layer")
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
    _REGISTRY[name] = method


def _instance(fn: Any) -> Any:
    """A class registers one instance of itself (made without arguments); anything else as it is."""
    return fn() if isinstance(fn, type) else fn


def register_importance(name: str, fn: Importance | None = None, *, replace: bool = False,
                        job_fields: Sequence[str] | None = None, check: Callable[[Any], None] | None = None,
                        keep_heads: KeepHeads | None = None, settings: type | None = None) -> Any:
    """Register ``fn(ctx) -> [scores of layer 0, scores of layer 1, ...]`` as method ``name``; as a
    decorator without ``fn``.  ``fn`` may also be a class whose instances are such callables (one
    instance is made).  ``keep_heads(ctx, n_keep, layer_floor)``: the method picks its heads itself from the
    context (iterative pruning) rather than keeping the ``n_keep`` best scores.  ``settings``: a dataclass of
    the method's own settings (default: ``fn.settings`` if it has one), read from the job as ``ctx.job.<field>``
    and given as flags by ``headbudget prune``.  Returns ``fn``.

        register_importance("taylor", lambda ctx: [np.abs(g) for g in gate_gradients(ctx.adapter, ctx.model,
                                                                                      ctx.batches)])
    """
    def add(f: Any) -> Any:
        if not callable(f):
            raise TypeError(f"register_importance({name!r}): {f!r} is not callable")
        _register(PruningMethod(name, importance=_instance(f), keep_heads=keep_heads, job_fields=job_fields,
                                check=check, settings=settings or getattr(f, "settings", None)), replace)
        return f

    return add if fn is None else add(fn)


def register_selector(name: str, fn: Selector | None = None, *, finds_count: bool = False, replace: bool = False,
                      job_fields: Sequence[str] | None = None, check: Callable[[Any], None] | None = None,
                      importance: Importance | None = None, keeps_layer_floor: bool = False,
                      settings: type | None = None) -> Any:
    """Register ``fn(run: MethodRun) -> Selection`` as method ``name`` (as a decorator without ``fn``):
    a method that picks the kept heads itself, e.g. ``lambda run: Selection(kept=my_heads(run.model,
    run.target))``.  ``finds_count``: it may be called with ``run.target=None`` and choose the count;
    ``importance``: one-shot scores the selector is built from, if any (:func:`score_heads` gives them);
    ``keeps_layer_floor``: the method always keeps a head per layer (``cahp``); ``settings``: as
    :func:`register_importance`'s."""
    def add(f: Any) -> Any:
        if not callable(f):
            raise TypeError(f"register_selector({name!r}): {f!r} is not callable")
        _register(PruningMethod(name, importance=importance, selector=_instance(f), finds_count=finds_count,
                                job_fields=job_fields, check=check, keeps_layer_floor=keeps_layer_floor,
                                settings=settings or getattr(f, "settings", None)), replace)
        return f

    return add if fn is None else add(fn)


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
            continue
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
    """The registered methods that score heads, ``{name: importance}``: read-only, live (a method registered
    later is in it)."""

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
    """``{name: importance}`` of every registered method with one score per head: a read-only, live view of the
    registry."""
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
    """Kept flat indices (and the flat scores, when the method has one final score) of a scoring method: one that
    picks its heads itself (``keep_heads``, e.g. ``michel``) has no final score; any other keeps its ``n_keep``
    best heads (``layer_floor=False``: globally, a layer may keep none)."""
    registered = _REGISTRY.get(method)
    if registered is not None and registered.keep_heads is not None:
        return registered.keep_heads(ctx, n_keep, layer_floor), None
    scores = score_heads(method, ctx)
    return select_top(scores, n_keep, layer_floor=layer_floor), flatten(scores)


def with_method_settings(cls: type) -> type:
    """``cls`` (a :class:`~headbudget.pruning.job.PruneJob` class) with the settings of every registered method
    joined in (:func:`~headbudget.pruning.job.join_settings`): how a plug-in's settings reach ``headbudget prune``."""
    return join_settings(cls, [m.settings for m in _REGISTRY.values() if m.settings is not None])


def method_job_fields() -> dict[str, tuple[str, ...]]:
    """``{method: job fields only it reads}`` for the methods that have any."""
    return {name: m.job_fields for name, m in _REGISTRY.items() if m.job_fields}


# --------------------------------------------------------------------------- built-in selectors
def _cahp_accuracy_curve(run: MethodRun) -> tuple[Callable[[list[int]], float] | None, list[int] | None]:
    """``--curve accuracy``: the knee from measured accuracy of the primary split at every ``curve_step``-th
    head count (classification, no forced count); else no curve."""
    from headbudget.pruning.finetune import evaluate_accuracy
    from headbudget.pruning.workloads import ClassificationWorkload

    job, loaded, counts = run.job, run.workload, run.head_counts
    if not (job.curve == "accuracy" and run.target is None and isinstance(loaded, ClassificationWorkload)):
        return None, None
    curve_examples = loaded.evals[loaded.primary]

    def accuracy_fn(kept: list[int]) -> float:
        with run.adapter.set_gate_values(gate_mask(kept, counts)):
            return evaluate_accuracy(run.model, loaded.tokenizer, curve_examples, 64, job.max_length, False)

    return accuracy_fn, list(range(2, sum(counts), max(1, job.curve_step)))


def _cahp(run: MethodRun) -> Selection:
    """CAHP (:func:`headbudget.pruning.cahp.cahp_select`) with the job's settings, plus its two plots."""
    from headbudget.pruning import report as rpt

    job, loaded = run.job, run.workload
    accuracy_fn, accuracy_ks = _cahp_accuracy_curve(run)
    settings: CahpSettings = job  # a PruneJob is its CahpSettings
    if job.salience_order == "file":  # the workload cut the first salience_fraction of the examples already
        sal_batches, settings = loaded.salience_batches(job), dataclasses.replace(job, salience_fraction=1.0)
    else:
        sal_batches = run.importance_batches
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
    from headbudget.pruning import workloads

    job = run.job
    assert run.target is not None
    authors = job.method in FROM_PRETRAINED
    start = workloads.load_pretrained_into(job, run.workload, run.model) if authors else "model"
    settings = gated.GateSettings(lr=job.gate_lr, epochs=job.joint_epochs if authors else job.gate_epochs,
                                  cooldown=job.gate_cooldown, weight_lr=job.lr, seed=job.seed)
    res = gated.train_gates(job.method, run.adapter, run.model, run.importance_batches[: job.importance_batches],
                            run.target, settings, progress=job.progress, layer_floor=layer_floor_of(job))
    info = dict(res.info, start=start)
    return Selection(kept=res.kept, details=dict(scores=res.logits, gate_training=info, gate_history=res.history))


def _attattr(run: MethodRun) -> Selection:
    """AttAttr scores on the first ``attattr_examples`` examples of the primary evaluation split."""
    from headbudget.pruning.workloads import ClassificationWorkload

    job, loaded = run.job, run.workload
    assert run.target is not None and isinstance(loaded, ClassificationWorkload)
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
    # each gate method's fingerprint reads only the gate settings it uses (job_fields narrows DspPassSettings)
    register_selector("pipelined-dsp", _gated, job_fields=("gate_lr", "gate_epochs", "gate_cooldown"),
                      check=gated.check_job, settings=DspPassSettings)
    # the plain names are the authors' joint protocols; before they were, joint-dsp meant joint-dsp-finetuned and
    # pass meant pass-frozen (a run folder of the old meaning lacks pretrained / joint_epochs in its recorded
    # settings, so a resumed comparison reruns it)
    authors = ("gate_lr", "pretrained", "joint_epochs")
    register_selector("joint-dsp", _gated, job_fields=(*authors, "gate_cooldown"), check=gated.check_joint_job,
                      settings=DspPassSettings)
    register_selector("joint-dsp-finetuned", _gated, job_fields=("gate_lr", "gate_epochs", "gate_cooldown"),
                      check=gated.check_job, settings=DspPassSettings)
    register_selector("pass", _gated, job_fields=authors, check=gated.check_joint_job, settings=DspPassSettings)
    register_selector("pass-frozen", _gated, job_fields=("gate_lr", "gate_epochs"), check=gated.check_job,
                      settings=DspPassSettings)
    register_selector("attattr", _attattr, check=attattr.check_job, settings=AttAttrSettings)


_register_builtins()
