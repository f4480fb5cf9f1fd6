"""Start-up time: ``headbudget schedule`` and the light imports, against ``import torch`` for scale.

Each case runs in a fresh interpreter ``--repeats`` times (interleaved); the table shows the median and
the fastest wall time and whether torch / transformers were imported.  Writes JSON.

    python benchmarks/startup.py                   # benchmarks/results/startup.json
    python benchmarks/startup.py --repeats 10 --out /tmp/startup.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROBE = "; import sys; print(json.dumps([m in sys.modules for m in ('torch', 'transformers')]))"

CASES: dict[str, list[str]] = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "import headbudget": [sys.executable, "-c", "import json, headbudget" + PROBE],
    "import headbudget.schedules, accounting, budget": [
        sys.executable, "-c", "import json, headbudget.schedules, headbudget.accounting, headbudget.budget" + PROBE],
    "headbudget schedule --preset gpt2-124m --kind prism": [
        sys.executable, "-c", "import json, io, contextlib; from headbudget.cli.main import main\n"
        "with contextlib.redirect_stdout(io.StringIO()): main(['schedule', '--preset', 'gpt2-124m', '--kind', 'prism'])\n"
        "import sys; print(json.dumps([m in sys.modules for m in ('torch', 'transformers')]))"],
    "import torch": [sys.executable, "-c", "import json, torch" + PROBE],
    "import headbudget.models": [sys.executable, "-c", "import json, headbudget.models" + PROBE],
}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "startup.json"))
    args = ap.parse_args(argv)
    cases = dict(CASES)
    exe = shutil.which("headbudget")
    if exe:  # the console script as a user types it (its own wrapper's start-up included)
        cases["$ headbudget schedule --preset gpt2-124m --kind prism"] = [
            exe, "schedule", "--preset", "gpt2-124m", "--kind", "prism"]
    times: dict[str, list[float]] = {k: [] for k in cases}
    loaded: dict[str, list[bool] | None] = {}
    for _ in range(args.repeats):
        for name, cmd in cases.items():
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
            times[name].append(time.perf_counter() - t0)
            last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
            loaded[name] = json.loads(last) if last.startswith("[") else None
    rows = [{"case": k, "median_s": statistics.median(v), "min_s": min(v), "repeats": len(v),
             "imports_torch": loaded[k][0] if loaded[k] else None,
             "imports_transformers": loaded[k][1] if loaded[k] else None} for k, v in times.items()]
    print(f"{'case':<58} {'median s':>9} {'min s':>7} {'torch':>6} {'transformers':>13}")
    for r in rows:
        print(f"{r['case']:<58} {r['median_s']:>9.3f} {r['min_s']:>7.3f} {str(r['imports_torch']):>6} "
              f"{str(r['imports_transformers']):>13}")
    result = {"python": sys.version.split()[0], "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{out}")
    return result


if __name__ == "__main__":
    main()
