"""Prism vs uniform (and the controls) on two real corpora with the cpu-small preset.

For each corpus this runs ``headbudget compare`` with the schedules uniform (the preset's 4 heads of
64), prism (1,1,2,2,4,4 heads of 256,256,128,128,64,64), reverse, and the wide-head controls
uniform@128 and uniform@256 (all layers at the head widths prism uses), then prints one table
(mean ± std of the final val loss over seeds, the paired difference to uniform, tokens/s, peak memory)
and writes ``benchmark.json``.  Without the wide-head controls a prism win cannot be told apart from
"wider heads are better at this size".

Full run (hours on 2 shared cores)::

    python benchmarks/prism_vs_uniform_cpu.py --out runs/bench

Reduced run (what fits in minutes)::

    python benchmarks/prism_vs_uniform_cpu.py --steps 60 --seeds 2 --schedules uniform,prism,uniform@256 \\
        --set train.context=128 --out runs/bench-small
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data" / "text"
DATASETS = {
    # name: (file, split at blank lines into documents?)
    "tinyshakespeare": ("tinyshakespeare.txt", False),
    "movie_reviews": ("movie_reviews.txt", True),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "cpu-small.yaml"))
    ap.add_argument("--datasets", default="tinyshakespeare,movie_reviews")
    ap.add_argument("--schedules", default="uniform,prism,reverse,uniform@128,uniform@256")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, help="override train.steps (the config's 400 by default)")
    ap.add_argument("--tokenizer", default="bpe:2048", help="tokenizer trained on each corpus (default bpe:2048)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", default="runs/bench-prism-vs-uniform-cpu")
    args = ap.parse_args(argv)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    from headbudget.train.compare import parse_schedules, run_compare
    from headbudget.train.config import CompareConfig, load_config

    hf_logging.disable_progress_bar()
    schedules = parse_schedules(args.schedules)
    out = Path(args.out)
    results: dict[str, dict] = {}
    t0 = time.perf_counter()
    for name in [d.strip() for d in args.datasets.split(",") if d.strip()]:
        if name not in DATASETS:
            print(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}", file=sys.stderr)
            return 2
        fname, blank = DATASETS[name]
        path = SHARED / fname
        if not path.is_file():
            print(f"skipping {name}: {path} not found", file=sys.stderr)
            continue
        overrides = [f"data.source={path}", f"data.tokenizer={args.tokenizer}",
                     f"data.split_blank_lines={str(blank).lower()}", f"name={name}", "train.ckpt_every=0"]
        if args.steps:
            overrides.append(f"train.steps={args.steps}")
        cfg = load_config(args.config, overrides + args.overrides)
        print(f"== {name}: {len(schedules)} schedules x {args.seeds} seeds, {cfg.train.steps} steps x "
              f"{cfg.train.batch_size} x {cfg.train.context} tokens", flush=True)

        def on_run(sched, seed, r):
            print(f"   {sched:>12} seed {seed}: val {r.final_val_loss:.4f}  {r.tokens_per_s:,.0f} tok/s  "
                  f"{r.wall_s:.0f}s", flush=True)

        settings = CompareConfig.from_run(cfg, schedules=args.schedules, seeds=args.seeds, save_models=False)
        summary = run_compare(settings, out / name, on_run=on_run)
        results[name] = {"schedules": summary["schedules"], "runs": summary["runs"], "data": summary["data"],
                         "config": summary["config"]}

    if not results:
        print("no dataset found; nothing run", file=sys.stderr)
        return 1
    header = f"{'corpus':<16} {'schedule':<12} {'heads':<14} {'val loss':>17} {'Δ vs ' + schedules[0]:>17} " \
             f"{'tokens/s':>9} {'peak MB':>8}"
    print("\n" + header + "\n" + "-" * len(header))
    for name, res in results.items():
        for sched, s in res["schedules"].items():
            n = s["n_runs"]
            val = f"{s['val_loss_mean']:.4f} ± {s['val_loss_std']:.4f}" if n > 1 else f"{s['val_loss_mean']:.4f}"
            d = "—" if sched == schedules[0] else (
                f"{s['delta_vs_baseline_mean']:+.4f} ± {s['delta_vs_baseline_std']:.4f}" if n > 1
                else f"{s['delta_vs_baseline_mean']:+.4f}")
            print(f"{name:<16} {sched:<12} {','.join(map(str, s['heads'])):<14} {val:>17} {d:>17} "
                  f"{s['tokens_per_s_mean']:>9,.0f} {s['peak_memory_mb_mean']:>8,.0f}")
    record = {"command": " ".join([sys.executable, *sys.argv]), "args": vars(args),
              "wall_s": time.perf_counter() - t0, "results": results}
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / ".benchmark.json.tmp"
    tmp.write_text(json.dumps(record, indent=2))
    os.replace(tmp, out / "benchmark.json")
    print(f"\nwrote {out / 'benchmark.json'} (per-corpus reports in {out}/<corpus>/report.md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
