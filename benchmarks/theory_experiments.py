"""Evidence for the allocation theory (docs/allocation.md): both synthetic experiments, saturation and n-gram
extraction, at their default sizes.

    python benchmarks/theory_experiments.py            # ~10-15 min on 2 shared CPU cores
    python benchmarks/theory_experiments.py --quick    # smoke run

Writes benchmarks/results/theory/{saturation,ngram}.{json,png} and prints the measured tables and
the verdicts (whether or not they agree with the theory).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from headbudget.experiments.ngram import NgramConfig, format_ngram, run_ngram, write_ngram
from headbudget.experiments.saturation import (
    SaturationConfig,
    format_saturation,
    run_saturation,
    write_saturation,
)

OUT = Path(__file__).resolve().parent / "results" / "theory"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", choices=["saturation", "ngram"], default=None)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    if args.only in (None, "saturation"):
        cfg = SaturationConfig.quick() if args.quick else SaturationConfig()
        res = run_saturation(cfg)
        paths = write_saturation(res, args.out)
        print("== saturation ==")
        print(format_saturation(res))
        print("wrote", *paths)
    if args.only in (None, "ngram"):
        cfg = NgramConfig.quick() if args.quick else NgramConfig()
        res = run_ngram(cfg)
        paths = write_ngram(res, args.out)
        print("== ngram ==")
        print(format_ngram(res))
        print("wrote", *paths)


if __name__ == "__main__":
    main()
