"""The settings of one pruning run (:class:`PruneJob`), apart from the pipeline that runs it so the workloads,
the comparison and the CLI can all import it without importing :mod:`headbudget.pruning.pipeline`.

    >>> from headbudget.pruning.job import PruneJob
    >>> PruneJob("runs/ft", "sst5", "../shared/data/classification/sst5", "runs/cahp").method
    'cahp'
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from headbudget.typed_config import coerce, device_option, dtype_option, option

#: the titles PruneJob's flags are grouped under in ``headbudget prune --help`` (the rest: every method's)
CAHP = "CAHP: signatures, clustering and the knee"
BASELINES = ("baselines (michel, fisher, magnitude, random, pipelined-dsp, joint-dsp, joint-dsp-finetuned, pass, "
             "pass-frozen, attattr)")
RECOVERY = "recovery fine-tuning"
LM = "task lm: label-free pruning of a causal LM"

#: the entry-point group through which an installed package adds importances: ``name = "module:function"``
#: registers ``function`` as method ``name`` (:func:`headbudget.pruning.methods.load_plugins`)
ENTRY_POINT_GROUP = "headbudget.importance"


@dataclass
class CahpSettings:
    """The settings only ``cahp`` reads: signatures, t-SNE, clustering, the knee and the representatives.

        >>> CahpSettings(pool_size=8).mss
        'mean'
    """

    poly_degree: int = option(6, help="Kneedle polynomial degree (lower keeps more heads)", group=CAHP)
    pool_size: int = option(32, help="signature grid size B (B x B per head)", group=CAHP)
    perplexity: float = option(10.0, help="t-SNE perplexity (clipped below #heads)", group=CAHP)
    mss: str = option("mean", help="silhouette variant: published mean-of-other-medoids, or textbook nearest",
                      choices=("mean", "nearest"), group=CAHP)
    curve: str = option("mss", help="knee of MSS vs k (default) or of measured dev accuracy vs heads kept",
                        choices=("mss", "accuracy"), group=CAHP)
    curve_step: int = option(1, help="k step of the accuracy curve", group=CAHP)
    salience_fraction: float = option(
        0.25, help="share of the training set for salience (first int(f*n) examples, file order)", group=CAHP)
    salience_order: str = option(
        "file", help="salience data: the first examples in file order (published code) or the first batches of "
                     "the seeded shuffle", choices=("file", "shuffled"), group=CAHP)
    ddof: int = option(1, help="class-conditional signature variance: 1 = sample (published code), 0 = population",
                       group=CAHP)
    var_floor: float | None = option(
        1e-6, help="max(var, floor) before Jeffries-Matusita (published: 1e-6); none: var + var_eps",
        group=CAHP)
    var_eps: float = option(0.0, help="added to the signature variance (legacy: 1e-10 with var_floor none)",
                            group=CAHP)
    tsne_dtype: str = option("float32", help="float type of t-SNE (published: float32)",
                             choices=("float32", "float64"), group=CAHP)
    # cahp selection (None: the mode's default -- classification the published salience / one head per
    # cluster; task lm cahp.LM_DEFAULTS: fisher, importance allocation over 30 clusters)
    representative: str | None = option(
        None, help="cahp: the score that picks each cluster's head (default: salience for sst5/mnli, fisher "
                   "for lm)", choices=("salience", "fisher"), group=CAHP)
    allocation: str | None = option(
        None, help="cahp: one head per cluster (published; default for sst5/mnli) or the head count spread over "
                   "--clusters clusters by summed importance (default for lm)", choices=("cluster", "importance"),
                   group=CAHP)
    n_clusters: int | None = option(
        None, help="cahp --allocation importance: number of clusters (default 30)", flag="--clusters",
        group=CAHP)


@dataclass
class DspPassSettings:
    """The settings of the gate-training baselines (:mod:`headbudget.pruning.gated`; defaults: the published
    SST-5 settings).  The joint ones train the weights at the job's ``lr``, from the pre-trained model for the
    authors' protocols (joint-dsp, pass), from the job's ``model`` for the -finetuned / -frozen variants.

        >>> DspPassSettings().gate_lr
        0.5
    """

    gate_lr: float = option(
        0.5, help="pipelined-dsp / joint-dsp / pass and their variants: learning rate of the head logits "
                  "(published: 0.5)", group=BASELINES)
    gate_epochs: int = option(
        1, help="pipelined-dsp / joint-dsp-finetuned / pass-frozen: passes over the training batches for gate "
                "training (joint-dsp / pass: joint_epochs)", group=BASELINES)
    gate_cooldown: int | None = option(
        None, help="pipelined-dsp / joint-dsp / joint-dsp-finetuned: steps to anneal the temperature 1000 -> "
                   "1e-8 (default: the published SST-5 setting, 90 pipelined / 270 joint)", group=BASELINES)
    pretrained: str | None = option(
        None, help="joint-dsp / pass: the pre-trained model their authors' joint training starts from (a "
                   "classifier gets a fresh head); required for sst5/mnli, task lm defaults to the model itself",
        metavar="MODEL", group=BASELINES)
    joint_epochs: int = option(
        3, help="joint-dsp / pass: epochs of joint gate and weight training from the pre-trained model "
                "(the authors': 3)", group=BASELINES)


@dataclass
class AttAttrSettings:
    """The settings of ``attattr`` (:mod:`headbudget.pruning.attattr`).

        >>> AttAttrSettings().attattr_steps
        20
    """

    attattr_examples: int = option(
        200, help="attattr: first N examples of the primary evaluation split (published: 200)",
        group=BASELINES)
    attattr_steps: int = option(20, help="attattr: integrated-gradients steps (published: 20)",
                                group=BASELINES)


@dataclass
class _PruneSettings:
    """What every method of a pruning run shares: inputs, the head count, recovery, evaluation and task lm."""

    model: str = option(
        help="fine-tuned classifier folder (or wheel / pruned model); with task lm a causal LM folder, a "
             "`headbudget train` run folder or a GGUF file", metavar="MODEL")
    task: str = option(help="classification task, or lm: label-free pruning of a causal LM (metric: perplexity)",
                       choices=("sst5", "mnli", "lm"))
    data_dir: str | None = option(help="sst5/mnli: folder with the task's files")
    out: str = option(help="output folder")
    method: str = option("cahp", help="cahp or a baseline: michel, fisher, magnitude, random, pipelined-dsp, "
                                      "joint-dsp, joint-dsp-finetuned, pass, pass-frozen, attattr, or a method "
                                      "registered with headbudget.pruning.methods")
    keep: int | None = option(None, help="force the number of heads kept (skips the knee)")
    keep_ratio: float | None = option(None, help="force the fraction of heads kept")
    importance_batches: int | None = option(
        None, help="baselines: training batches their gradient importance uses (default all)",
        group=BASELINES)
    finetune_epochs: int | None = option(
        None, help="recovery fine-tuning epochs (default: 3, and 0 for task lm, where an epoch is one pass over "
                   "the calibration windows)", group=RECOVERY)
    lr: float = option(2e-5, help="recovery fine-tuning learning rate", group=RECOVERY)
    warmup_ratio: float = option(0.1, help="recovery fine-tuning: share of the steps with linear warmup",
                                 group=RECOVERY)
    weight_decay: float = option(0.01, help="recovery fine-tuning: AdamW weight decay", group=RECOVERY)
    batch_size: int = option(32, help="batch size (signatures, salience, fine-tuning, evaluation)")
    seed: int = option(42, help="seed of subsampling, shuffling, t-SNE and fine-tuning")
    limit_train: int | None = option(None, help="seeded subsample of the training split")
    limit_eval: int | None = option(None,
                                    help="seeded subsample of each eval split (lm: at most N held-out windows)")
    max_length: int = option(128, help="classification: longest tokenized example")
    device: str | None = device_option()
    dtype: str = dtype_option()
    progress: bool = option(True, help="no progress bars", flag="--no-progress")
    save_model: bool = option(True, help="write OUT/model", cli=False)
    # task "lm"
    data: str | None = option(None, help="lm: text file (calibration windows + held-out tail)", group=LM)
    tokenizer: str | None = option(
        None, help="tokenizer instead of the model's own (a folder, byte, gpt2[:DIR], hf:NAME)")
    context: int = option(128, help="lm: window length in tokens", group=LM)
    calib_windows: int = option(32, help="lm: calibration windows (signatures, salience)", group=LM)
    heldout_fraction: float = option(0.1, help="lm: share of the text's tokens (its end) held out for perplexity",
                                     group=LM)
    calib_seed: int | None = option(
        None, help="lm: draw the calibration windows with this seed (default: the first calib_windows windows)",
        group=LM)
    eval_data: tuple[str, ...] = option(
        (), help="lm: comma list of more held-out text files, each scored by perplexity (at most --limit-eval "
                 "windows) and named by its file stem in the tables", group=LM)
    knee_warn_ratio: float = option(
        2.0, help="task lm, knee-chosen count: warn when pruned perplexity exceeds this x dense (0: off)",
        group=LM)
    # every baseline's final ranking (cahp keeps its floor: its paper states it)
    layer_floor: bool = option(
        True, help="baselines: rank heads globally, so a layer may lose every head, as the baselines' papers do "
                   "(cahp keeps one head per layer)", flag="--no-layer-floor", group=BASELINES)
    # which heads may go together (:mod:`headbudget.pruning.granularity`)
    granularity: str = option(
        "head", help="grouped-query models: any query heads (head; on SmolLM2-135M at 70% it kept 80 of 90 kv "
                     "heads: KV cache -11%, decode 0.97-1.21x dense, and its GGUF export adds 55 duplicated "
                     "key/value heads: not a serving win), whole kv groups so the KV cache shrinks (group; 63 of "
                     "90, -30%, decode 1.07-1.38x), or the same number of query heads per kv head in a layer "
                     "(balanced; 73 of 90). Measured: benchmarks/RESULTS.md, 'Decode speed of pruned "
                     "grouped-query models' and 'llama.cpp runs the exported GGUF'",
        choices=("head", "group", "balanced"))
    extra: dict[str, Any] = option(help="free-form settings recorded with the run", cli=False,
                                   default_factory=dict)


@dataclass
class PruneJob(AttAttrSettings, DspPassSettings, CahpSettings, _PruneSettings):
    """Everything one pruning run needs: the settings every method shares and each built-in method's own (a
    plug-in's join them, :func:`headbudget.pruning.methods.with_method_settings`).  Each field declares its
    flag once (:func:`headbudget.typed_config.option`): the flags of ``prune`` / ``prune-compare``,
    ``--config`` files and ``--print_config`` are generated from these fields.  ``model`` is anything
    :func:`headbudget.loading.load_model` opens; exactly one of ``keep`` (heads) / ``keep_ratio`` forces the
    head count, else CAHP takes it from its knee."""

    def __post_init__(self) -> None:
        if self.finetune_epochs is None:  # resolved here, so Python callers, --config files and flags agree
            self.finetune_epochs = default_finetune_epochs(self.task)

    def finetune_recipe(self) -> FinetuneRecipe:
        """The recovery fine-tuning of a classifier job."""
        return FinetuneRecipe(epochs=self.finetune_epochs, lr=self.lr, warmup_ratio=self.warmup_ratio,
                              weight_decay=self.weight_decay, batch_size=self.batch_size, seed=self.seed,
                              max_length=self.max_length, progress=self.progress)


@dataclass
class PruneCompareJob(PruneJob):
    """``headbudget prune-compare``: the settings every method shares (a PruneJob, ``method`` aside) and the
    comparison's own; :func:`headbudget.pruning.compare.run_prune_compare` takes it whole.

        >>> PruneCompareJob("runs/ft", "sst5", "data/sst5", "runs/cmp", methods="cahp,random").prune_job().method
        'cahp'
    """

    methods: str = option("cahp,michel,fisher,magnitude,random",
                          help="comma list; cahp@D sets CAHP's polynomial degree (e.g. cahp@2,cahp@6,michel)")
    calibration_seeds: tuple[int, ...] | None = option(
        None, help="lm: comma list of seeds, e.g. 0,1,2: the comparison once per seed (calibration windows drawn "
                   "with it, in OUT/seed<s>), then mean, std and min-max per method and text and a ranking that "
                   "names a method only if it is best on every text")
    ranking_rule: str = option("mean", choices=("mean", "range"),
                               help="with --calibration-seeds: best = better mean on every text (mean), or worst "
                                    "seed better than every other method's best seed on every text (range)")

    def __post_init__(self) -> None:
        super().__post_init__()
        # "0,1,2" or [0, 1, 2] from Python, as the flag and a config file give them
        self.calibration_seeds = coerce(self.calibration_seeds, tuple[int, ...] | None, "calibration_seeds")

    def prune_job(self) -> PruneJob:
        """The settings every method of the comparison shares."""
        # the plug-in settings this class was joined with (with_method_settings) join PruneJob the same way
        cls = join_settings(PruneJob, [b for b in type(self).__bases__ if b is not PruneCompareJob])
        return cls(**{f.name: getattr(self, f.name) for f in dataclasses.fields(cls)})


def join_settings(cls: type, settings: list[type]) -> type:
    """``cls`` (a job dataclass) with the fields of each of ``settings`` it lacks joined in, after its own: a
    plug-in method's settings become flags, config keys and ``--print_config`` lines like the built-ins'.

        >>> @dataclass
        ... class Offset:
        ...     offset: int = option(0, help="my method's setting")
        >>> job = join_settings(PruneJob, [Offset, CahpSettings])("m", "lm", None, "o", offset=2)
        >>> job.offset, isinstance(job, PruneJob), join_settings(PruneJob, [CahpSettings]) is PruneJob
        (2, True, True)
    """
    extra = list(dict.fromkeys(s for s in settings if not issubclass(cls, s)))
    if not extra:
        return cls
    names = [f.name for s in extra for f in dataclasses.fields(s)]
    clash = sorted({n for n in names if names.count(n) > 1} | (set(names) & {f.name for f in dataclasses.fields(cls)}))
    if clash:
        raise TypeError(f"method settings {', '.join(clash)} are declared twice (or are {cls.__name__}'s own)")
    # dataclass fields follow the reversed MRO: cls's (its required ones first), then extra's in order
    return dataclasses.make_dataclass(cls.__name__, [], bases=(*reversed(extra), cls))


def require_positive(job: Any, *names: str) -> None:
    """A one-line ``ValueError`` naming the first of ``names`` whose value is set and below 1.

    >>> require_positive(PruneJob("m", "lm", None, "o", keep=0), "keep")
    Traceback (most recent call last):
    ValueError: keep must be >= 1, got 0
    """
    for name in names:
        value = getattr(job, name)
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


def default_finetune_epochs(task: str) -> int:
    """Recovery fine-tuning epochs when a job names none: 3 for a classifier, 0 for task ``lm`` (a pruned LM
    is scored as it is unless recovery is asked for).

    >>> default_finetune_epochs("sst5"), PruneJob("runs/lm", "lm", None, "runs/p").finetune_epochs
    (3, 0)
    """
    return 0 if task == "lm" else 3


@dataclass
class FinetuneRecipe:
    """How a sequence classifier is fine-tuned (:func:`headbudget.pruning.finetune.finetune` takes it whole): AdamW
    without decay on biases and LayerNorm, linear warmup then linear decay, dynamic padding; the defaults are the
    published recipe.

        >>> FinetuneRecipe(epochs=1, limit_train=200).batch_size
        32
    """

    epochs: int = option(3, help="passes over the training set")
    lr: float = option(2e-5, help="peak learning rate (AdamW, linear warmup then linear decay)")
    warmup_ratio: float = option(0.1, help="share of the steps with linear warmup")
    weight_decay: float = option(0.01, help="AdamW weight decay")
    batch_size: int = option(32, help="examples per step (dynamic padding)")
    max_length: int = option(128, help="longest tokenized example")
    seed: int = option(0, help="seed of shuffling, subsampling, dropout and a new classifier head")
    limit_train: int | None = option(None, help="seeded subsample of the training split")
    limit_eval: int | None = option(None, help="seeded subsample of each eval split")
    max_steps: int | None = option(None, help="stop after N optimizer steps")
    precision: str = option("fp32", choices=("fp32", "bf16", "auto"),
                            help="bf16: training forward passes under bf16 autocast (weights, optimizer and "
                                 "evaluations stay fp32)")
    max_grad_norm: float | None = option(1.0, help="clip the gradient norm (null: no clipping)", cli=False)
    eval_batch_size: int = option(64, help="examples per evaluation batch", cli=False)
    progress: bool = option(True, help="no progress bars", flag="--no-progress")


@dataclass
class _FinetuneInputs:
    model: str = option(help="model folder, unpacked wheel, .whl or pruned model", metavar="MODEL")
    task: str = option(help="classification task", choices=("sst5", "mnli"))
    data_dir: str = option(help="folder with the task's files")
    out: str = option(help="output folder")


@dataclass
class FinetuneJob(FinetuneRecipe, _FinetuneInputs):
    """``headbudget finetune``: fine-tune a sequence classifier; the job is its own recipe
    (:func:`headbudget.pruning.finetune.run_finetune` takes it whole).

        >>> FinetuneJob("runs/ft", "sst5", "../shared/data/classification/sst5", "runs/ft2", epochs=1).lr
        2e-05
    """

    device: str | None = device_option()


__all__ = ["FinetuneJob", "FinetuneRecipe", "PruneCompareJob", "PruneJob", "default_finetune_epochs"]
