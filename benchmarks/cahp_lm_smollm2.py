"""Label-free CAHP vs its baselines on SmolLM2-135M-Instruct, scored so that a ranking has to hold:
calibrate on one text, score three held-out texts.

Protocol: calibrate on ``--calib-data`` (default: movie reviews; ``--calib-windows`` windows of ``--context``
tokens, drawn per calibration seed with :func:`headbudget.pruning.lm.calibration_offsets`, from the text
before its held-out last ``--heldout-fraction``), prune with :func:`headbudget.pruning.pipeline.run_prune`
(``task="lm"``, no fine-tune) at every ``--ratios`` keep ratio, and score every pruned model on

* three held-out texts by perplexity, the first ``--eval-windows`` windows of ``--context`` tokens of each:
  the calibration text's held-out tail (never calibrated on) and every ``--eval-data`` text (default:
  WikiText-2 valid and tinyshakespeare, neither used for calibration);
* zero-shot arc_easy and piqa, the first ``--limit`` examples of each
  (:func:`headbudget.evaluation.zeroshot.evaluate_tasks`, data in ``../shared/data/zeroshot``);

for every calibration seed in ``--seeds`` (seed s: windows drawn with s; the run's seed -- random's draw,
t-SNE, shuffles -- is 42 + s).  magnitude reads only the weights, so its seed-0 selection is scored once and
stands for every seed (its spread is 0 by construction; the row says so).  Per method, ratio and text the
results give mean, sample std and min-max over the seeds, and the ranking of
:func:`headbudget.evaluation.rankings.rank_methods` (``rule="mean"``: a method is best only if its mean
beats every other method's mean on every text; else "no method best").

Resumable: every (method, ratio, seed) lives in ``OUT/<method>-r<ratio>-s<seed>/`` (``report.json``,
``eval.json``; the pruned model is deleted once scored); a finished one is skipped.  The GGUF is converted
once to ``OUT/base``.  The results JSON and the plot are rewritten after every unit.

    nice -n 10 python benchmarks/cahp_lm_smollm2.py --threads 1           # the full protocol
    python benchmarks/cahp_lm_smollm2.py --table                          # markdown tables from the JSON
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SHARED = HERE.parents[1] / "shared" / "data"
ORDER = ("dense", "cahp", "fisher", "michel", "random", "magnitude")
ZS_TASKS = ("arc_easy", "piqa")
SEED_FREE = ("magnitude",)  # selection reads only the weights: identical for every calibration seed


def parse_variants(specs: list[str]) -> dict[str, dict[str, Any]]:
    """``LABEL:field=value,field=value`` -> ``{LABEL: {field: value}}`` (PruneJob fields of a cahp variant)."""
    from dataclasses import fields

    from headbudget.pruning.job import PruneJob

    names = {f.name for f in fields(PruneJob)}
    out: dict[str, dict[str, Any]] = {}
    for spec in specs:
        label, _, rest = spec.partition(":")
        kw: dict[str, Any] = {}
        for item in filter(None, rest.split(",")):
            k, _, v = item.partition("=")
            if k not in names:
                raise SystemExit(f"--variant {spec!r}: {k!r} is not a PruneJob field")
            kw[k] = int(v) if v.lstrip("-").isdigit() else v
        out[label] = kw
    return out


def ensure_base(out: Path, gguf: str) -> Path:
    """The GGUF converted once to a headbudget folder (model + tokenizer)."""
    base = out / "base"
    if not (base / "config.json").exists():
        from headbudget.loading import load_model_and_tokenizer

        model, tok = load_model_and_tokenizer(gguf, "causal", as_headbudget=True)
        model.save_pretrained(str(base))
        tok.save_pretrained(str(base))
    return base


def zero_shot(model: Any, tok: Any, args: argparse.Namespace) -> dict[str, Any]:
    from headbudget.evaluation.zeroshot import evaluate_tasks

    zs = evaluate_tasks(model, tok, list(ZS_TASKS), data_dir=args.zeroshot_dir, limit=args.limit, batch_size=16,
                        progress=False)
    return {t: {k: zs["results"][t][k] for k in ("acc", "acc_stderr", "n")} for t in ZS_TASKS}


def texts_of(rows: list[dict[str, Any]]) -> list[str]:
    return list(rows[0]["ppl"]) if rows else []


def aggregate(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per ratio: per method and metric the spread over seeds, and the rankings (perplexity over the texts,
    zero-shot accuracy over the tasks)."""
    from headbudget.evaluation.rankings import rank_methods, spread

    out: dict[str, Any] = {}
    texts = texts_of(rows)
    for ratio in sorted({r["ratio"] for r in rows if r["label"] != "dense"}, reverse=True):
        group = [r for r in rows if r["ratio"] == ratio]
        labels = sorted({r["label"] for r in group}, key=lambda m: (ORDER.index(m) if m in ORDER else 99, m))
        ppl = {m: {t: [r["ppl"][t] for r in group if r["label"] == m] for t in texts} for m in labels}
        acc = {m: {t: [r[t]["acc"] for r in group if r["label"] == m] for t in ZS_TASKS} for m in labels}
        entry: dict[str, Any] = {
            "heads_kept": group[0]["heads_kept"],
            "seeds": {m: sorted(r["seed"] for r in group if r["label"] == m) for m in labels},
            "ppl": {m: {t: spread(v) for t, v in d.items()} for m, d in ppl.items()},
            "zero_shot": {m: {t: spread(v) for t, v in d.items()} for m, d in acc.items()},
        }
        main = [m for m in labels if m in ORDER]  # cahp variants are ranked against cahp only
        if len(main) > 1:
            entry["ranking_ppl"] = rank_methods({m: ppl[m] for m in main}, lower_is_better=True)
            entry["ranking_ppl_range"] = rank_methods({m: ppl[m] for m in main}, lower_is_better=True, rule="range")
            entry["ranking_zero_shot"] = rank_methods({m: acc[m] for m in main}, lower_is_better=False)
        cahps = [m for m in labels if m == "cahp" or m not in ORDER]
        if "cahp" in cahps and len(cahps) > 1:
            entry["ranking_cahp_variants_ppl"] = rank_methods({m: ppl[m] for m in cahps}, lower_is_better=True)
        out[f"{ratio:.2f}"] = entry
    return out


def write_results(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    from headbudget.io import atomic_write_json

    skip = ("methods", "out", "results", "plot", "table")
    settings = {k: v for k, v in vars(args).items() if k not in skip}
    rows = sorted(rows, key=lambda r: (-r["ratio"], ORDER.index(r["label"]) if r["label"] in ORDER else 99,
                                       r["seed"] if r["seed"] is not None else -1))
    atomic_write_json(Path(args.results), {
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1, de-quantized)", "heads_total": 270, "settings": settings,
        "protocol": "calibrate on one text, score three held-out texts + zero-shot, 3 calibration "
                    "seeds, mean / sample std / min-max, a method best only if best on every text",
        "rows": rows, "aggregate": aggregate(rows)}, indent=1)
    plot(rows, Path(args.plot))


def markdown_tables(data: dict[str, Any]) -> str:
    """benchmarks/RESULTS.md's tables: per ratio, perplexity per text and zero-shot accuracy per task as
    mean ± std [min–max] over the seeds (n seeds per method), each column's winner in bold, then the ranking."""
    from headbudget.evaluation.rankings import RULES

    rows = data["rows"]
    dense = next((r for r in rows if r["label"] == "dense"), None)
    texts = texts_of(rows)
    out = []
    if dense is not None:
        out.append("Dense: " + ", ".join(f"{t} ppl {dense['ppl'][t]:.2f}" for t in texts) + ", "
                   + ", ".join(f"{t} acc {dense[t]['acc']:.3f}" for t in ZS_TASKS) + "\n")
    for ratio, e in data["aggregate"].items():
        out.append(f"**Keep {float(ratio):.0%} ({e['heads_kept']}/270 heads)**\n")
        cols = [(t, "ppl", f"{t} ppl", 2) for t in texts] + [(t, "zero_shot", f"{t} acc", 3) for t in ZS_TASKS]
        lines = ["| method | seeds | " + " | ".join(c[2] for c in cols) + " |", "|---|---|" + "---:|" * len(cols)]
        for m, seeds in e["seeds"].items():
            cells = []
            for t, kind, _, dig in cols:
                s = e[kind][m][t]
                c = f"{s['mean']:.{dig}f} ± {s['std']:.{dig}f} [{s['min']:.{dig}f}–{s['max']:.{dig}f}]"
                rank = e.get("ranking_ppl" if kind == "ppl" else "ranking_zero_shot")
                cells.append(f"**{c}**" if rank and rank["per_text"].get(t) == m else c)
            note = (" (weights only: one selection)" if m in SEED_FREE else
                    " (cahp variant, not in the ranking)" if m not in ORDER else "")
            lines.append(f"| {m}{note} | {','.join(map(str, seeds))} | " + " | ".join(cells) + " |")
        out.append("\n".join(lines) + "\n")
        if "ranking_ppl" in e:
            out.append(f"Perplexity ranking (rule: {RULES['mean']}): **{e['ranking_ppl']['label']}**; stricter "
                       f"(non-overlapping min-max): **{e['ranking_ppl_range']['label']}**. Zero-shot ranking "
                       f"(same rule over arc_easy, piqa): **{e['ranking_zero_shot']['label']}**.\n")
        if "ranking_cahp_variants_ppl" in e:
            rv = e["ranking_cahp_variants_ppl"]
            out.append(f"cahp against its variants (perplexity, same rule): **{rv['label']}** (per text: "
                       + ", ".join(f"{t} {w or 'none'}" for t, w in rv["per_text"].items()) + ").\n")
    return "\n".join(out)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    texts = texts_of(rows)
    panels = [(t, "ppl", f"{t} perplexity") for t in texts] + [(t, "acc", f"{t} acc") for t in ZS_TASKS]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8))
    labels = [m for m in ORDER if m != "dense" and any(r["label"] == m for r in rows)]
    dense = next((r for r in rows if r["label"] == "dense"), None)

    def val(r: dict[str, Any], key: str, kind: str) -> float:
        return r["ppl"][key] if kind == "ppl" else r[key]["acc"]

    for ax, (key, kind, title) in zip(axes, panels):
        for i, lab in enumerate(labels):
            pts = [(r["ratio"] + 0.025 * (i - 2), val(r, key, kind)) for r in rows if r["label"] == lab]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o" if lab == "cahp" else "s", label=lab, ms=4,
                    alpha=0.8, color=f"C{i}")
        if dense is not None:
            ax.axhline(val(dense, key, kind), color="k", lw=0.8, ls=":", label="dense")
        if kind == "ppl":
            ax.set_yscale("log")
        ratios = sorted({r["ratio"] for r in rows if r["label"] != "dense"})
        ax.set_xticks(ratios, [f"{x:.0%}" for x in ratios])
        ax.set_xlabel("heads kept (methods side by side)")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("SmolLM2-135M-Instruct, label-free pruning (no fine-tune): one point per calibration seed")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", help="SmolLM2-135M-Instruct's .gguf file (needed to run, not for --table)")
    ap.add_argument("--calib-data", default=str(SHARED / "text" / "movie_reviews.txt"))
    ap.add_argument("--eval-data", default=",".join(str(SHARED / "text" / f) for f in
                                                    ("wikitext2_valid.tokens", "tinyshakespeare.txt")))
    ap.add_argument("--zeroshot-dir", default=str(SHARED / "zeroshot"))
    ap.add_argument("--out", default="runs/cahp_lm_seeds")
    ap.add_argument("--methods", default="dense,cahp,fisher,random,magnitude,michel")
    ap.add_argument("--variant", action="append", default=[],
                    help="LABEL:field=value,... a cahp variant (PruneJob fields) usable as a --methods label, "
                         "e.g. cahp-c15:n_clusters=15")
    ap.add_argument("--ratios", default="0.70,0.50")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--calib-windows", type=int, default=8)
    ap.add_argument("--heldout-fraction", type=float, default=0.1)
    ap.add_argument("--eval-windows", type=int, default=8, help="perplexity windows per text")
    ap.add_argument("--limit", type=int, default=100, help="zero-shot examples per task")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--results", default=str(HERE / "results" / "cahp_lm_smollm2_seeds.json"))
    ap.add_argument("--plot", default=str(HERE / "results" / "cahp_lm_smollm2_seeds.png"))
    ap.add_argument("--table", action="store_true",
                    help="only print the results file as markdown tables (and redraw the plot from it)")
    args = ap.parse_args()
    if args.table:
        data = json.loads(Path(args.results).read_text())
        data["aggregate"] = aggregate(data["rows"])  # the rule as the code states it now
        print(markdown_tables(data))
        plot(data["rows"], Path(args.plot))
        return

    if args.gguf is None:
        ap.error("--gguf is required (SmolLM2-135M-Instruct's .gguf file), except with --table")
    import torch

    torch.set_num_threads(args.threads)
    from headbudget.io import atomic_write_json
    from headbudget.loading import load_model_and_tokenizer
    from headbudget.pruning.job import PruneJob
    from headbudget.pruning.pipeline import run_prune
    from headbudget.pruning.workloads import LMWorkload

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    variants = parse_variants(args.variant)
    for m in methods:
        if m not in ORDER and m not in variants:
            raise SystemExit(f"--methods: unknown method {m!r}; choose from {', '.join(ORDER)} or a --variant")
    ratios = [float(r) for r in args.ratios.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    base = ensure_base(out, args.gguf)
    rows = [json.loads(ev.read_text()) for ev in sorted(out.glob("*/eval.json"))]
    done = {(r["label"], r["ratio"], r["seed"]) for r in rows}
    base_job = PruneJob(str(base), "lm", None, "", data=args.calib_data, context=args.context,
                        calib_windows=args.calib_windows, heldout_fraction=args.heldout_fraction, finetune_epochs=0,
                        progress=False, limit_eval=args.eval_windows,
                        eval_data=tuple(p for p in args.eval_data.split(",") if p))
    loaded: LMWorkload | None = None

    def get_loaded() -> LMWorkload:
        nonlocal loaded
        if loaded is None:
            loaded = LMWorkload(base_job)
            dense = next((r for r in rows if r["label"] == "dense"), None)
            if dense is not None:
                loaded.dense_acc = {("heldout" if k.endswith("(held-out tail)") else k): v
                                    for k, v in dense["ppl"].items()}
        return loaded

    def text_names(ppl: dict[str, float]) -> dict[str, float]:
        calib = Path(args.calib_data).stem
        return {(f"{calib} (held-out tail)" if k == "heldout" else k): float(v) for k, v in ppl.items()}

    plan: list[tuple[str, float, int | None]] = [("dense", 1.0, None)] if "dense" in methods else []
    plan += [(m, r, s) for r in ratios for s in seeds for m in methods if m != "dense"]
    for label, ratio, seed in plan:
        if (label, ratio, seed) in done:
            continue
        d = out / ("dense" if seed is None else f"{label}-r{ratio:.2f}-s{seed}")
        t0 = time.perf_counter()
        if seed is None:
            ld = get_loaded()
            model, tok = ld.fresh_model(base_job), ld.tokenizer
            ppl = ld.evaluate(model, base_job, "dense")
            ld.dense_acc = dict(ppl)  # run_prune reuses it instead of scoring the dense model again
            row: dict[str, Any] = {"label": "dense", "method": "dense", "ratio": 1.0, "seed": None,
                                   "heads_kept": 270, "ppl": text_names(ppl)}
        elif label in SEED_FREE and seed != seeds[0] and (label, ratio, seeds[0]) in done:
            first = next(r for r in rows if (r["label"], r["ratio"], r["seed"]) == (label, ratio, seeds[0]))
            row = dict(first, seed=seed, copied_from_seed=seeds[0], seconds={"total": 0.0})
            model = None
        else:
            ld = get_loaded()
            ld.use_calibration_seed(base_job, seed)
            job = replace(base_job, method="cahp" if label in variants else label, out=str(d), keep_ratio=ratio,
                          calib_seed=seed, seed=42 + seed, **variants.get(label, {}))
            if not ((d / "report.json").exists() and (d / "model").is_dir()):
                res = run_prune(job, ld)
                details = res["details"]
            else:
                details = json.loads((d / "details.json").read_text())
            rep = json.loads((d / "report.json").read_text())
            model, tok = load_model_and_tokenizer(str(d / "model"), "causal")
            row = {"label": label, "method": job.method, "ratio": ratio, "seed": seed, "heads_kept": rep["heads_kept"],
                   "options": variants.get(label, {}),
                   "kept_per_layer": [len(rep["kept"][str(i)]) for i in range(len(rep["kept"]))],
                   "calib_offsets": details.get("calib_offsets"),
                   "ppl": text_names({k: v["pruned"] for k, v in details["perplexity"].items()}),
                   "seconds": {"prune": rep["seconds"]}}
        if model is not None:
            model.eval()
            row.update(zero_shot(model, tok, args))
            row.setdefault("seconds", {})["total"] = round(time.perf_counter() - t0, 1)
        d.mkdir(parents=True, exist_ok=True)
        # atomic: a resumed run json-loads every eval.json, so an interrupted write must not leave half of one
        atomic_write_json(d / "eval.json", row, indent=1)
        if (d / "model").is_dir():
            shutil.rmtree(d / "model")  # 0.5 GB each; report.json keeps the kept heads
        rows.append(row)
        done.add((label, ratio, seed))
        write_results(args, rows)
        print(f"[done] {d.name}: heads {row['heads_kept']} "
              + " ".join(f"{k} {v:.2f}" for k, v in row["ppl"].items())
              + " " + " ".join(f"{t} {row[t]['acc']:.3f}" for t in ZS_TASKS)
              + f" ({row['seconds']['total']:.0f} s)", flush=True)
        del model
    if rows:
        write_results(args, rows)
        print(markdown_tables(json.loads(Path(args.results).read_text())))


if __name__ == "__main__":
    sys.exit(main())
