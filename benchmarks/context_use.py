"""How much of their context do trained models use? Loss by context length, per schedule.

A head schedule can only matter through attention. This measures, for each trained model of the Prism
study found under ``--runs``, the held-out loss of the same target tokens given 1, 2, 4, ... tokens of
left context (``headbudget.evaluation.perplexity.loss_by_context_length``; paired by target), and the
gain over one token of context. A model that ignores its context gains nothing. One text (the study's
held-out tail); descriptive, not part of the registered study (docs/prism_study.md).

    python benchmarks/context_use.py --runs runs/prism_study/cpu-tiny --size cpu-tiny \
        --out benchmarks/results/context_use_cpu-tiny.json
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", required=True,
                    help="folder of RUN/model folders, e.g. runs/prism_study/cpu-tiny (benchmarks/prism_study.py)")
    ap.add_argument("--size", default="cpu-tiny", help="the study size the runs were trained at")
    ap.add_argument("--every", type=int, default=48, help="a target every N held-out tokens")
    ap.add_argument("--targets", type=int, default=2048, help="at most this many targets per model")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="JSON (default benchmarks/results/context_use_SIZE.json); "
                    "a PNG of the curves is written beside it")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import prism_study
    import torch

    from headbudget.evaluation.perplexity import loss_by_context_length
    from headbudget.io import atomic_write_json, save_figure
    from headbudget.loading import load_model
    from headbudget.train.setup import prepare_for

    torch.set_num_threads(args.threads)
    if args.size not in prism_study.SIZES:
        print(f"context_use: unknown --size {args.size!r}; choose from {', '.join(prism_study.SIZES)}",
              file=sys.stderr)
        return 2
    models = sorted(p.parent.parent for p in Path(args.runs).glob("*/model/config.json"))
    if not models:
        print(f"context_use: no RUN/model/config.json under {args.runs}", file=sys.stderr)
        return 2
    context = prism_study.SIZES[args.size]
    cfg = prism_study.run_config(args.size, "uniform", 0, context * 16, args.threads, None)
    data = prepare_for(cfg, progress=False)
    ids = torch.as_tensor(data.val.astype("int64"))
    lengths = tuple(k for k in (1, 2, 4, 8, 16, 32, 64, 127) if k < context)
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for run in models:
        m = re.fullmatch(r"(.+)-seed(\d+)", run.name)
        schedule, seed = (m.group(1), int(m.group(2))) if m else (run.name, None)
        r = loss_by_context_length(load_model(run / "model"), ids, lengths=lengths, every=args.every,
                                   max_targets=args.targets)
        rows.append({"run": str(run), "schedule": schedule, "seed": seed, **r})
        print(f"{run.name:>28}  " + "  ".join(f"{k}: {v:.3f}" for k, v in zip(r["lengths"], r["loss"]))
              + f"   gain {lengths[-1]} vs 1: {r['gain_vs_shortest'][-1]:+.3f} ± {r['gain_sem'][-1]:.3f}", flush=True)
    by_schedule: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_schedule.setdefault(r["schedule"], []).append(r)

    def mean(rs: list[dict[str, Any]], key: str) -> list[float]:
        return [sum(col) / len(col) for col in zip(*(r[key] for r in rs))]

    means = {s: {"seeds": [r["seed"] for r in rs], "loss": mean(rs, "loss"), "gain_vs_1": mean(rs, "gain_vs_shortest")}
             for s, rs in by_schedule.items()}
    print(f"\nheld-out loss (nats/token) by tokens of left context, mean over seeds; {rows[0]['targets']} "
          f"targets, one every {args.every} tokens, the same for every length")
    print(f"{'schedule':>20}  " + "  ".join(f"{k:>6}" for k in lengths) + f"  gain {lengths[-1]} vs 1")
    for s, m in means.items():
        print(f"{s:>20}  " + "  ".join(f"{v:6.3f}" for v in m["loss"]) + f"  {m['gain_vs_1'][-1]:+.3f}")

    out = Path(args.out) if args.out else prism_study.RESULTS / f"context_use_{args.size}.json"
    atomic_write_json(out, {"command": " ".join([sys.executable, *sys.argv]), "size": args.size,
                            "context": context, "heldout_tokens": int(ids.numel()), "lengths": list(lengths),
                            "wall_s": time.perf_counter() - t0,
                            "mean_by_schedule": means, "runs": rows})
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for k, (s, m) in enumerate(means.items()):
        ax.plot(lengths, m["loss"], "-o", color=f"C{k}", label=s)
    ax.set(xscale="log", xlabel="tokens of left context", ylabel="held-out loss (nats/token)",
           title=f"{args.size}: loss by context length (mean over seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
