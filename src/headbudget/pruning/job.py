"""The settings of one pruning run (:class:`PruneJob`), apart from the pipeline that runs it so the workloads,
the comparison and the CLI can all import it without importing :mod:`headbudget.pruning.pipeline`.

    >>> from headbudget.pruning.job import PruneJob
    >>> PruneJob("runs/ft", "sst5", "../shared/data/classification/sst5", "runs/cahp").method
    'cahp'
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class PruneJob:
    """Everything one pruning run needs (``headbudget prune``'s flags are these fields).

    ``model`` is anything :func:`headbudget.loading.load_model` opens; ``tokenizer`` (lm) overrides the
    model's own.  Exactly one of ``keep`` (heads) / ``keep_ratio`` forces the head count; CAHP
    otherwise takes it from the knee of its curve.

        run_prune(PruneJob("runs/ft", "sst5", "../shared/data/classification/sst5", "runs/cahp"))
    """

    model: str
    task: str
    data_dir: str | None
    out: str
    method: str = "cahp"
    keep: int | None = None
    keep_ratio: float | None = None
    poly_degree: int = 6
    pool_size: int = 32
    perplexity: float = 10.0
    mss: str = "mean"
    curve: str = "mss"
    curve_step: int = 1
    salience_fraction: float = 0.25
    salience_order: str = "file"  # "file": first int(fraction * n) training examples in file order (published code)
    importance_batches: int | None = None
    finetune_epochs: int = 3
    lr: float = 2e-5
    warmup_ratio: float = 0.1
    weight_decay: float = 0.01
    batch_size: int = 32
    seed: int = 42
    limit_train: int | None = None
    limit_eval: int | None = None
    max_length: int = 128
    device: str | None = None
    dtype: str = "auto"  # float type of the model's weights (headbudget.loading.DTYPES); auto: the checkpoint's
    progress: bool = True
    save_model: bool = True
    # task "lm"
    data: str | None = None
    tokenizer: str | None = None
    context: int = 128
    calib_windows: int = 32
    heldout_fraction: float = 0.1
    # None: the first calib_windows windows of the text; a seed: windows drawn with it (lm.calibration_offsets)
    calib_seed: int | None = None
    # more held-out texts scored by perplexity besides data's tail (named by file stem in tables)
    eval_data: tuple[str, ...] = ()
    ddof: int = 1  # class-conditional signature variance: 1 = sample (published code), 0 = population
    var_floor: float | None = 1e-6  # max(var, 1e-6) before Jeffries-Matusita; None with var_eps=1e-10: var + 1e-10
    var_eps: float = 0.0
    tsne_dtype: str = "float32"
    # label-free lm mode, knee-chosen count: warn when pruned perplexity > this x dense (0: never)
    knee_warn_ratio: float = 2.0
    # cahp selection (None: the mode's default -- classification the published salience / one head per
    # cluster; task lm cahp.LM_DEFAULTS: fisher, importance allocation over 30 clusters)
    representative: str | None = None
    allocation: str | None = None
    n_clusters: int | None = None
    # gate-training baselines (pipelined-dsp, joint-dsp, pass; :mod:`headbudget.pruning.gated`): the published
    # SST-5 settings -- logit learning rate 0.5, DSP cooldown 90 (pipelined) / 270 (joint) steps (None: those);
    # joint-dsp trains the weights at ``lr``
    gate_lr: float = 0.5
    gate_epochs: int = 1
    gate_cooldown: int | None = None
    # attattr (:mod:`headbudget.pruning.attattr`): the first N examples of the primary evaluation split, m steps
    attattr_examples: int = 200
    attattr_steps: int = 20
    # which heads may go together (:mod:`headbudget.pruning.granularity`): "head" (any), "group" (whole kv
    # groups: the KV cache shrinks) or "balanced" (the same number of query heads per kv head in a layer)
    granularity: str = "head"
    extra: dict[str, Any] = field(default_factory=dict)


__all__ = ["PruneJob"]
