"""What one pruning job works on: the model, its tokenizer and data, loaded once and shared by
``prune-compare``'s methods: :class:`ClassificationWorkload` (``sst5``, ``mnli``: a classifier, accuracy) or
:class:`LMWorkload` (``task="lm"``: a causal LM as a headbudget model, held-out perplexity), both a
:class:`Workload`.

    >>> from headbudget.pruning.job import PruneJob
    >>> work = load_workload(PruneJob("runs/ft", "sst5", "../shared/data/classification/sst5", "runs/cahp"))
    ...                                                                              # doctest: +SKIP
    >>> work.evaluate(work.fresh_model(job), job, "dense")                           # doctest: +SKIP
"""

from __future__ import annotations

import copy
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

from headbudget.io import atomic_write_dir
from headbudget.pruning.job import PruneJob


def _placement(job: PruneJob) -> tuple[Any, Any]:
    """The job's device and dtype (a one-line error naming the flag of a bad one)."""
    from headbudget.devices import resolve_device, resolve_dtype

    return resolve_device(job.device, flag="device"), resolve_dtype(job.dtype, flag="dtype")


class _Loaded:
    """What both workloads share: the loaded model, deep-copied per method, and how a pruned one is saved."""

    _sidecar: bool  # save_pruned's kept_heads.json: encoders, whose HF class cannot record per-layer heads
    tokenizer: Any
    device: Any

    def _loaded(self, model: Any, t0: float) -> None:
        self._pristine = model  # a fresh deep copy per method (prune-compare)
        self.heads_total = sum(model_adapter(model).head_counts())
        self.load_seconds = time.perf_counter() - t0
        self.dense_acc: dict[str, float] | None = None

    def fresh_model(self, job: PruneJob) -> Any:
        return copy.deepcopy(self._pristine).to(self.device).eval()

    def save(self, model: Any, out: Path) -> None:
        """``save_pretrained`` of model and tokenizer into one folder, atomically."""
        from headbudget.models.surgery import save_pruned

        def write(tmp: Path) -> None:
            if self._sidecar:
                save_pruned(model, tmp, self.tokenizer)
            else:
                model.save_pretrained(str(tmp))
                self.tokenizer.save_pretrained(str(tmp))

        atomic_write_dir(out, write)


class ClassificationWorkload(_Loaded):
    """Model, tokenizer and data of a classification job (loaded once, shared by prune-compare's methods)."""

    metric_name = "accuracy"
    n_classes: int | None
    _sidecar = True

    def __init__(self, job: PruneJob) -> None:
        from headbudget.data.classification import get_task, load_task, subsample
        from headbudget.loading import load_model_and_tokenizer

        t0 = time.perf_counter()
        self.spec = get_task(job.task)
        self.data = load_task(job.task, job.data_dir)
        self.device, dtype = _placement(job)
        model, self.tokenizer = load_model_and_tokenizer(
            job.model, "classifier", tokenizer=job.tokenizer, num_labels=self.spec.num_labels,
            label_names=self.spec.label_names, seed=job.seed, dtype=dtype)
        self.train = subsample(self.data.train, job.limit_train, job.seed)
        self.evals = {s: subsample(self.data.splits[s], job.limit_eval, job.seed) for s in self.data.eval_splits}
        if not self.evals:
            raise ValueError(f"task {job.task}: no evaluation split found in {job.data_dir}")
        self.primary = next(iter(self.evals))
        self._loaded(model, t0)
        self.n_classes = self.spec.num_labels

    def evaluate(self, model: Any, job: PruneJob, stage: str) -> dict[str, float]:
        from headbudget.pruning.finetune import evaluate_accuracy

        return {s: evaluate_accuracy(model, self.tokenizer, ex, 64, job.max_length, job.progress,
                                     f"{stage} {s}") for s, ex in self.evals.items()}

    def batches(self, job: PruneJob, shuffle: bool) -> list[Any]:
        from headbudget.data.classification import make_loader

        return list(make_loader(self.train, self.tokenizer, job.batch_size, shuffle, job.seed, job.max_length))

    def salience_batches(self, job: PruneJob) -> list[Any]:
        """The first ``int(salience_fraction * n)`` training examples in file order (the published code)."""
        from headbudget.data.classification import make_loader

        m = max(1, int(job.salience_fraction * len(self.train)))
        return list(make_loader(self.train[:m], self.tokenizer, job.batch_size, False, job.seed, job.max_length))

    def describe(self, job: PruneJob) -> dict[str, Any]:
        return {"model": str(job.model), "task": job.task, "primary_split": self.primary,
                "train_examples": len(self.train), "eval_examples": {s: len(v) for s, v in self.evals.items()}}

    def finetune(self, model: Any, job: PruneJob) -> tuple[dict[str, float], Any]:
        from headbudget.pruning.finetune import finetune

        hist = finetune(model, self.tokenizer, {"train": self.train, **self.evals}, job.finetune_recipe())
        return dict(hist["final"]), hist["epochs"]

    def details(self) -> dict[str, Any]:
        """What the run's details.json adds for this task: nothing beyond the accuracies."""
        return {}


class LMWorkload(_Loaded):
    """A causal LM, its tokenizer and the tokenized text of a ``task="lm"`` job (label-free CAHP;
    metric: held-out perplexity, lower is better)."""

    metric_name = "perplexity"
    n_classes = None
    _sidecar = False

    def __init__(self, job: PruneJob) -> None:
        from headbudget.loading import load_model_and_tokenizer
        from headbudget.pruning.lm import _token_ids, split_lm_ids

        t0 = time.perf_counter()
        self.device, dtype = _placement(job)
        model, self.tokenizer = load_model_and_tokenizer(job.model, "causal", tokenizer=job.tokenizer,
                                                         as_headbudget=True, dtype=dtype)
        cfg = model.config
        n_pos = getattr(cfg, "n_positions", None) or getattr(cfg, "max_position_embeddings", None)
        if n_pos is not None and job.context > int(n_pos):
            raise ValueError(f"context {job.context} exceeds the model's {n_pos} positions ({job.model})")
        vocab = int(model.get_input_embeddings().weight.shape[0])
        self._ids = _token_ids(self.tokenizer, str(job.data), vocab)  # kept: other seeds re-cut the windows
        self.data = split_lm_ids(self._ids, str(job.data), context=job.context, calib_windows=job.calib_windows,
                                 heldout_fraction=job.heldout_fraction, calib_seed=job.calib_seed)
        self.evals = {"heldout": self.data.heldout}
        # extra held-out texts (eval_data): each scored whole (at most limit_eval windows), named by its stem
        for path in job.eval_data:
            name = eval_text_name(path)
            if name in self.evals:
                raise ValueError(f"eval_data {path}: a second text named {name!r} (names are file stems)")
            self.evals[name] = _token_ids(self.tokenizer, path, vocab)
        self.primary = "heldout"
        self._loaded(model, t0)
        self.last_eval: dict[str, Any] = {}

    def use_calibration_seed(self, job: PruneJob, seed: int | None) -> None:
        """Re-cut the calibration windows with ``seed`` (:func:`headbudget.pruning.lm.calibration_offsets`);
        the held-out tail and the eval texts stay, so the dense scores stay valid."""
        from headbudget.pruning.lm import split_lm_ids

        self.data = split_lm_ids(self._ids, self.data.source, context=job.context, calib_windows=job.calib_windows,
                                 heldout_fraction=job.heldout_fraction, calib_seed=seed)

    def evaluate(self, model: Any, job: PruneJob, stage: str) -> dict[str, float]:
        from headbudget.pruning.lm import lm_perplexity

        res = lm_perplexity(model, self.data, max_windows=job.limit_eval, progress=job.progress)
        self.last_eval[stage] = res
        out = {"heldout": float(res["ppl"])}
        for name, ids in self.evals.items():
            if name == "heldout":
                continue
            # scored like the held-out tail: windows of context tokens every context - 1 tokens
            r = lm_perplexity(model, replace(self.data, heldout=ids), max_windows=job.limit_eval,
                              progress=job.progress)
            self.last_eval[f"{stage} {name}"] = r
            out[name] = float(r["ppl"])
        return out

    def batches(self, job: PruneJob, shuffle: bool) -> list[Any]:
        from headbudget.pruning.lm import lm_batches

        return lm_batches(self.data, job.batch_size, shuffle, job.seed)

    def salience_batches(self, job: PruneJob) -> list[Any]:
        """The first ``int(salience_fraction * n)`` calibration windows in text order."""
        from headbudget.pruning.lm import lm_batches

        m = max(1, int(job.salience_fraction * len(self.data.calib)))
        return lm_batches(replace(self.data, calib=self.data.calib[:m]), job.batch_size, False, job.seed)

    def describe(self, job: PruneJob) -> dict[str, Any]:
        out = {"model": str(job.model), "task": "lm", "data": str(job.data), "primary_split": "heldout",
               "tokenizer": job.tokenizer or "the model's own",
               "context": self.data.context, "tokens_total": self.data.tokens_total,
               "calib_windows": len(self.data.calib), "heldout_tokens": len(self.data.heldout)}
        if self.data.calib_seed is not None:
            out.update(calib_seed=self.data.calib_seed, calib_offsets=list(self.data.calib_offsets))
        if job.eval_data:
            out["eval_data"] = {eval_text_name(p): {"path": str(p), "tokens": len(self.evals[eval_text_name(p)])}
                                for p in job.eval_data}
        return out

    def finetune(self, model: Any, job: PruneJob) -> tuple[dict[str, float], Any]:
        from headbudget.pruning.lm import finetune_lm

        hist = finetune_lm(model, self.data, job.finetune_recipe())
        return self.evaluate(model, job, "finetuned"), hist

    def details(self) -> dict[str, Any]:
        """The perplexity runs behind the last evaluation (tokens and windows of each text)."""
        return {"perplexity_runs": dict(self.last_eval)}


class Workload(Protocol):
    """What :func:`headbudget.pruning.pipeline.run_prune` needs of a job's model and data, whatever the task
    (:class:`ClassificationWorkload`, :class:`LMWorkload`, or a task of a user's own)."""

    metric_name: str  #: "accuracy" (higher is better) or "perplexity" (lower is better)
    n_classes: int | None  #: classes of the signatures; None: label-free
    tokenizer: Any
    primary: str  #: the evaluation split (or text) the report ranks by
    evals: dict[str, Any]

    def fresh_model(self, job: PruneJob) -> Any: ...
    def evaluate(self, model: Any, job: PruneJob, stage: str) -> dict[str, float]: ...
    def batches(self, job: PruneJob, shuffle: bool) -> list[Any]: ...
    def salience_batches(self, job: PruneJob) -> list[Any]: ...
    def describe(self, job: PruneJob) -> dict[str, Any]: ...
    def details(self) -> dict[str, Any]: ...
    def finetune(self, model: Any, job: PruneJob) -> tuple[dict[str, float], Any]: ...
    def save(self, model: Any, out: Path) -> None: ...


def eval_text_name(path: str | Path) -> str:
    """The name an eval text goes by in tables: its file stem (``../data/wikitext2_valid.tokens`` ->
    ``wikitext2_valid``)."""
    return Path(path).stem


def load_workload(job: PruneJob) -> Workload:
    """The workload of ``job``: a causal LM for ``task="lm"``, else a classifier."""
    return LMWorkload(job) if job.task == "lm" else ClassificationWorkload(job)


def model_adapter(model: Any) -> Any:
    """The head adapter of ``model`` (imported late: adapters pull in the model families)."""
    from headbudget.models.surgery import get_adapter

    return get_adapter(model)


def load_pretrained_into(job: PruneJob, workload: Workload, model: Any) -> str:
    """Copy the pre-trained model's weights (``job.pretrained``; a classifier's head fresh from ``job.seed``)
    into ``model`` in place -- the pipeline prunes and fine-tunes that object -- and name the start.  Task lm
    without ``pretrained`` starts from the model itself: a causal LM is its own pre-trained model."""
    from headbudget import loading

    if job.pretrained is None:
        return "model"
    if isinstance(workload, ClassificationWorkload):
        pre = loading.load_model(job.pretrained, "classifier", num_labels=workload.spec.num_labels,
                                 label_names=workload.spec.label_names, seed=job.seed)
    else:
        pre = loading.load_model(job.pretrained, "causal", as_headbudget=True)
    mine, theirs = model.state_dict(), pre.state_dict()
    misfit = sorted(k for k in set(mine) | set(theirs)
                    if k not in mine or k not in theirs or mine[k].shape != theirs[k].shape)
    if misfit:
        raise ValueError(f"pretrained {job.pretrained}: {len(misfit)} of its tensors do not fit the model being "
                         f"pruned (first: {misfit[0]}); give the checkpoint {job.model} was fine-tuned from")
    model.load_state_dict(theirs)
    return "pretrained"
