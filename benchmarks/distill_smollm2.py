"""Recovery by distillation on SmolLM2-135M: prune heads, then distil vs plain LM training.

For each method x keep ratio: prune SmolLM2 with the library (:func:`headbudget.pruning.pipeline.run_prune`,
task lm, calibrated on the first ``--calib-chars`` of movie_reviews.txt), then train the pruned model for the
same ``--tokens`` on the *next* part of movie_reviews.txt twice with :func:`headbudget.train.train`: once
distilling from the dense model (``distill.teacher``: alpha*T^2*KL + (1-alpha)*CE), once with the plain LM
loss.  Optionally (``--svd-keep``) the same for an SVD-compressed model.  Scored (perplexity, first
``--max-windows`` windows of ``--score-context`` tokens) on held-out text used for neither calibration nor
training: WikiText-2 valid, the tail of movie_reviews.txt (``--tail-chars``), tinyshakespeare.

    python benchmarks/distill_smollm2.py --tokens 1M                          # the goal: hours on 2 CPU cores
    python benchmarks/distill_smollm2.py --tokens 10240 --methods fisher      # a short run: tokens/s, projection
    nohup python benchmarks/distill_smollm2.py --tokens 1M > runs/distill_smollm2.log 2>&1 &   # background
    python benchmarks/distill_smollm2.py --tokens 200k --methods fisher,cahp --keep-ratios 0.7,0.5 \
        --svd-keep 0.75 --batch-size 8 --context 256      # the run in RESULTS.md (bf16 autocast, ~10 min/run)
    python benchmarks/distill_smollm2.py --tokens 1M --methods fisher,cahp --keep-ratios 0.7,0.5 \
        --batch-size 8 --context 256 --device cuda          # on a GPU: prune, train and score there

Resumable and background-friendly: every pruned model, training run (checkpoints every ``--ckpt-every``
steps, ``resume=True``) and perplexity is cached under ``--work``; a rerun skips what exists.  Writes
``benchmarks/results/distill_smollm2.json`` after every finished row: per text the perplexity of the
dense, pruned, distilled and LM-trained models, the share of the pruned-to-dense perplexity gap each
recovery closes, tokens/s of both trainings and the projected wall time of 1M tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEXT = REPO.parent / "shared" / "data" / "text"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse_tokens(value: str) -> int:
    from headbudget.train.config import parse_token_count

    return parse_token_count(value)


def slices(args: argparse.Namespace, work: Path) -> dict[str, Path]:
    """calib / train / held-out texts: disjoint parts of movie_reviews.txt, plus two other held-out files."""
    reviews = (TEXT / "movie_reviews.txt").read_text(encoding="utf-8")
    tail_start = len(reviews) - args.tail_chars
    train_end = min(args.calib_chars + args.train_chars, tail_start)
    if train_end <= args.calib_chars:
        raise SystemExit("movie_reviews.txt is too short for --calib-chars + --tail-chars")
    parts = {"calib": reviews[:args.calib_chars], "train": reviews[args.calib_chars:train_end],
             "movie_reviews_tail": reviews[tail_start:],
             "wikitext2_valid": (TEXT / "wikitext2_valid.tokens").read_text(encoding="utf-8")[:args.score_chars],
             "tinyshakespeare": (TEXT / "tinyshakespeare.txt").read_text(encoding="utf-8")[:args.score_chars]}
    out = {}
    for name, text in parts.items():
        p = work / "text" / f"{name}.txt"
        if not p.exists() or p.read_text(encoding="utf-8") != text:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text, encoding="utf-8")
        out[name] = p
    return out


HELDOUT = ("wikitext2_valid", "movie_reviews_tail", "tinyshakespeare")
RECOVERIES = ("distilled", "lm_trained")
#: the settings that define what a row measured: a rerun adds rows to ``--out`` only when these agree
ROW_SETTINGS = ("model", "tokens", "batch_size", "grad_accum", "context", "lr", "temperature", "alpha",
                "calib_chars", "calib_windows", "train_chars", "tail_chars", "score_chars", "score_context",
                "max_windows")


def previous_result(out: Path, settings: dict) -> dict:
    """What ``out`` already holds, kept when a rerun adds rows (a session that runs one missing cell
    must not drop the rest); refused in one line when ``out`` was made with other row settings."""
    if not out.is_file():
        return {}
    old = json.loads(out.read_text())
    for key in ROW_SETTINGS:
        if old.get("settings", {}).get(key) != settings.get(key):
            raise SystemExit(f"{out} holds rows made with {key}={old.get('settings', {}).get(key)!r}, not "
                             f"{settings.get(key)!r}; pass another --out")
    return old


def check_same_model(name: str, old_ppl: dict | None, new_ppl: dict, out: Path) -> None:
    """A row's recoveries belong to one pruned model: refuse to add to a row whose pruned model (its
    perplexities, rel. 0.1%) differs from the one made now, e.g. a pruning that chose other heads
    (``name`` "dense": the teacher, whose perplexities every row's gap is measured from)."""
    if old_ppl is None:
        return
    for t in HELDOUT:
        if abs(new_ppl[t] - old_ppl[t]) > 1e-3 * old_ppl[t]:
            what = "dense model" if name == "dense" else "pruned model"
            raise SystemExit(f"{name}: the {what}'s {t} perplexity is {new_ppl[t]:.2f} now but {old_ppl[t]:.2f} "
                             f"in {out}: another {what}; pass another --out")


def score_checkpoint(run: Path, args: argparse.Namespace, texts: dict[str, Path]) -> dict:
    """Held-out perplexity of the newest checkpoint of an unfinished recovery run (its student folder as
    the model's shape), for a run that cannot finish in the time at hand; the LR schedule is mid-way."""
    import torch

    from headbudget.evaluation.perplexity import perplexity
    from headbudget.loading import load_model_and_tokenizer
    from headbudget.train.checkpoint import latest_checkpoint, load_checkpoint
    from headbudget.train.config import RunConfig

    ckpt = latest_checkpoint(run / "checkpoints")
    if ckpt is None:
        raise SystemExit(f"{run}: no checkpoint to score")
    student = RunConfig.load(run / "config.yaml").model.init
    # loaded as the trainer loads model.init (headbudget's class), whose parameter names the checkpoint holds
    model, tok = load_model_and_tokenizer(student, dtype=torch.float32, as_headbudget=True)
    state = load_checkpoint(ckpt, model, restore_rng=False)
    model = model.to(args.device or "cpu")
    res = {"run": str(run), "checkpoint": ckpt.name, "step": state.get("step"), "ppl": {}}
    with torch.no_grad():
        for name in HELDOUT:
            r = perplexity(model.eval(), tok, texts[name].read_text(encoding="utf-8"), context=args.score_context,
                           stride=args.score_context, max_windows=args.max_windows, progress=False)
            res["ppl"][name] = r["ppl"]
    return res


def perplexities(model_path: str, texts: dict[str, Path], args: argparse.Namespace, cache: Path) -> dict[str, float]:
    """Held-out perplexity on each text (cached in ``cache``)."""
    if cache.exists():
        return json.loads(cache.read_text())
    import torch

    from headbudget.evaluation.perplexity import perplexity
    from headbudget.io import atomic_write_json
    from headbudget.loading import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer(model_path, dtype=torch.float32)
    model = model.to(args.device or "cpu")
    res = {}
    with torch.no_grad():
        for name in HELDOUT:
            r = perplexity(model, tok, texts[name].read_text(encoding="utf-8"), context=args.score_context,
                           stride=args.score_context, max_windows=args.max_windows, progress=False)
            res[name] = r["ppl"]
    atomic_write_json(cache, res)
    return res


def prune(method: str, ratio: float, texts: dict[str, Path], args: argparse.Namespace, work: Path) -> Path:
    from headbudget.pruning.job import PruneJob
    from headbudget.pruning.pipeline import run_prune

    out = work / f"pruned-{method}-{ratio:g}"
    if not (out / "model" / "config.json").exists():
        t0 = time.perf_counter()
        run_prune(PruneJob(args.model, "lm", None, str(out), method=method, keep_ratio=ratio,
                           data=str(texts["calib"]), context=args.context, calib_windows=args.calib_windows,
                           limit_eval=2, finetune_epochs=0, progress=False, device=args.device))
        log(f"pruned {method} keep {ratio:g} in {time.perf_counter() - t0:.0f}s -> {out / 'model'}")
    return out / "model"


def compress(keep: float, texts: dict[str, Path], args: argparse.Namespace, work: Path) -> Path:
    from headbudget.compression.job import CompressJob
    from headbudget.compression.pipeline import run_compress

    out = work / f"svd-{keep:g}"
    if not (out / "model" / "config.json").exists():
        t0 = time.perf_counter()
        run_compress(CompressJob(args.model, str(out), keep_ratio=keep, data=str(texts["calib"]), context=args.context,
                                 max_windows=2, progress=False, device=args.device), threads=args.threads)
        log(f"SVD-compressed keep {keep:g} in {time.perf_counter() - t0:.0f}s -> {out / 'model'}")
    return out / "model"


def recover(student: Path, teacher: str | None, texts: dict[str, Path], args: argparse.Namespace,
            out: Path) -> dict:
    """Train ``student`` on the training slice (distilling from ``teacher`` when given); resumable."""
    from headbudget.train import RunConfig, train
    from headbudget.train.records import read_metrics

    per_step = args.batch_size * args.context
    steps = math.ceil(args.tokens / per_step)
    cfg = RunConfig.from_dict({
        "name": out.name, "seed": 0, "model": {"init": str(student)},
        "data": {"source": str(texts["train"]), "tokenizer": "model", "val_fraction": 0.02,
                 "cache_dir": str(out.parent / "data-cache")},
        "train": {"steps": steps, "batch_size": args.batch_size, "grad_accum": args.grad_accum,
                  "context": args.context, "lr": args.lr, "min_lr_ratio": 0.1,
                  "warmup_steps": max(1, steps // 20), "weight_decay": 0.0, "eval_every": steps,
                  "eval_batches": 4, "log_every": 1, "ckpt_every": args.ckpt_every, "keep_last": 1,
                  "threads": args.threads, "progress": False, "precision": args.precision,
                  "device": args.device or "cpu"},
        "distill": {"teacher": teacher, "temperature": args.temperature, "alpha": args.alpha}})
    summary = out / "summary.json"
    if not summary.exists():
        t0 = time.perf_counter()
        train(cfg, out, resume=True)
        log(f"{'distilled' if teacher else 'LM-trained'} {out.name}: {steps} steps in {time.perf_counter() - t0:.0f}s")
    s = json.loads(summary.read_text())
    metrics = read_metrics(out / "metrics.jsonl")
    # tokens/s of the steady state: the first logged step includes warm-up (allocations, first teacher pass)
    steady = [m["tokens_per_s"] for m in metrics[1:]] or [m["tokens_per_s"] for m in metrics]
    tps = sorted(steady)[len(steady) // 2]
    return {"steps": s["steps"], "tokens": s["tokens"], "wall_s": s["wall_s"], "tokens_per_s_median": tps,
            "projected_wall_h_1M_tokens": 1e6 / tps / 3600, "final_val_loss": s["final_val_loss"],
            "final_distill_kl": metrics[-1].get("distill_kl"), "first_distill_kl": metrics[0].get("distill_kl"),
            "model": str(out / "model")}


def table(result: dict) -> str:
    """Markdown: perplexity per held-out text (dense / pruned / distilled / LM-trained) and the gap closed."""
    dense = result["dense_ppl"]
    head = "| student | recovery | " + " | ".join(f"{t} ppl (gap closed)" for t in HELDOUT) + " | tokens/s |"
    lines = [head, "|---|---|" + "---:|" * (len(HELDOUT) + 1),
             "| dense (teacher) | — | " + " | ".join(f"{dense[t]:.2f}" for t in HELDOUT) + " | |"]
    for name, row in result["rows"].items():
        lines.append(f"| {name} | none | " + " | ".join(f"{row['ppl']['pruned'][t]:.2f}" for t in HELDOUT) + " | |")
        for kind in ("distilled", "lm_trained"):
            if kind in row.get("gap_closed", {}):
                cells = " | ".join(f"{row['ppl'][kind][t]:.2f} ({row['gap_closed'][kind][t]:.0%})" for t in HELDOUT)
                lines.append(f"| {name} | {kind} | {cells} | {row[kind]['tokens_per_s_median']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="the dense teacher (SmolLM2-135M-Instruct's .gguf file; not needed with --table)")
    ap.add_argument("--methods", default="fisher",
                    help="comma list of pruning methods (fisher, cahp, ...); empty: none (e.g. only --svd-keep)")
    ap.add_argument("--keep-ratios", default="0.7", help="comma list of head keep ratios, e.g. 0.7,0.5")
    ap.add_argument("--svd-keep", type=float, default=None, help="also recover an SVD-compressed model (keep ratio)")
    ap.add_argument("--tokens", type=parse_tokens, default=parse_tokens("1M"), help="training tokens per run (1M, 10k)")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--temperature", type=float, default=2.0)
    ap.add_argument("--alpha", type=float, default=1.0, help="weight of the KL (1-alpha: LM loss) when distilling")
    ap.add_argument("--calib-chars", type=int, default=200_000)
    ap.add_argument("--calib-windows", type=int, default=8)
    ap.add_argument("--train-chars", type=int, default=None,
                    help="training text (default: 5 characters per token of --tokens, at least 200k)")
    ap.add_argument("--tail-chars", type=int, default=300_000, help="held-out tail of movie_reviews.txt")
    ap.add_argument("--score-chars", type=int, default=200_000)
    ap.add_argument("--score-context", type=int, default=256)
    ap.add_argument("--max-windows", type=int, default=16)
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default=None, help="cpu (default) or cuda: pruning, training and scoring there "
                    "(with --precision auto, bf16 on a GPU that has it)")
    ap.add_argument("--precision", default="auto", choices=("bf16", "fp32", "auto"),
                    help="training precision; auto: bf16 autocast on CPUs with AMX/AVX-512 BF16 (measured 370 vs 170 "
                         "tokens/s distilling SmolLM2 on such a CPU), fp32 elsewhere (emulated bf16 was ~14x slower "
                         "on an AVX2-only CPU); scoring is always float32")
    ap.add_argument("--recoveries", default=",".join(RECOVERIES),
                    help="which recoveries to run per student: distilled, lm_trained (plain LM baseline) or both")
    ap.add_argument("--skip-lm", action="store_true", help="distil only (no plain LM baseline): --recoveries distilled")
    ap.add_argument("--work", default=str(REPO / "runs" / "distill_smollm2"))
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "distill_smollm2.json"))
    ap.add_argument("--table", action="store_true", help="print the markdown table of --out and exit")
    ap.add_argument("--score-checkpoint", metavar="RUN", help="score the newest checkpoint of an unfinished "
                    "recovery run folder (under --work) on the held-out texts, write JSON to --out and exit")
    args = ap.parse_args()
    if args.table:
        print(table(json.loads(Path(args.out).read_text())))
        return
    if args.model is None:
        ap.error("--model is required (SmolLM2-135M-Instruct's .gguf file), except with --table")
    if args.train_chars is None:
        args.train_chars = max(200_000, 5 * args.tokens)
    recoveries = ["distilled"] if args.skip_lm else [r.strip() for r in args.recoveries.split(",") if r.strip()]
    if bad := [r for r in recoveries if r not in RECOVERIES]:
        raise SystemExit(f"--recoveries: unknown {bad[0]!r}; choose from {', '.join(RECOVERIES)}")
    if not (TEXT / "movie_reviews.txt").is_file():
        raise SystemExit(f"{TEXT} not found (../shared/data/text next to the repository)")
    import torch

    from headbudget.devices import cpu_description, use_bf16_autocast
    from headbudget.io import atomic_write_json
    from headbudget.threads import configure_threads

    configure_threads(args.threads)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    texts = slices(args, work)
    if args.score_checkpoint:
        res = score_checkpoint(work / args.score_checkpoint, args, texts)
        res["command"] = " ".join(["python", *sys.argv])
        atomic_write_json(args.out, res)
        log(f"{res['checkpoint']}: {res['ppl']}")
        return
    old = previous_result(Path(args.out), vars(args))
    command = " ".join(["python", *sys.argv])
    result: dict = {"model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to float32)",
                    "command": command, "commands": [*old.get("commands", [old["command"]] if old else []), command],
                    "settings": dict(vars(args)),
                    "texts": {"calibration": "movie_reviews.txt[:calib_chars]",
                              "training": "movie_reviews.txt[calib_chars:calib_chars+train_chars]",
                              "heldout": {"wikitext2_valid": f"wikitext2_valid.tokens[:{args.score_chars}]",
                                          "movie_reviews_tail": f"movie_reviews.txt[-{args.tail_chars}:]",
                                          "tinyshakespeare": f"tinyshakespeare.txt[:{args.score_chars}]"}},
                    "rows": old.get("rows", {})}
    t0 = time.perf_counter()
    dense = perplexities(args.model, texts, args, work / "ppl-dense.json")
    check_same_model("dense", old.get("dense_ppl"), dense, Path(args.out))
    result["dense_ppl"] = dense
    log(f"dense ppl {dense}")
    students = [(f"{m}-{float(r):g}", lambda m=m, r=float(r): prune(m, r, texts, args, work))
                for r in args.keep_ratios.split(",") if r.strip() for m in args.methods.split(",") if m.strip()]
    if args.svd_keep is not None:
        students.append((f"svd-{args.svd_keep:g}", lambda: compress(args.svd_keep, texts, args, work)))
    for name, make in students:
        student = make()
        pruned_ppl = perplexities(str(student), texts, args, work / f"ppl-{name}-pruned.json")
        log(f"{name}: pruned ppl {pruned_ppl}")
        old = result["rows"].get(name, {})
        check_same_model(name, old.get("ppl", {}).get("pruned"), pruned_ppl, Path(args.out))
        row: dict = {**old, "student": str(student), "ppl": {**old.get("ppl", {}), "pruned": pruned_ppl}}
        for kind in recoveries:
            teacher = args.model if kind == "distilled" else None
            rec = recover(student, teacher, texts, args, work / f"{kind}-{name}-{args.tokens}")
            trained_bf16 = use_bf16_autocast(args.precision, torch.device(args.device or "cpu"))
            rec |= {"precision": "bf16" if trained_bf16 else "fp32", "cpu": cpu_description()}
            row[kind] = rec
            row["ppl"][kind] = perplexities(rec["model"], texts, args, work / f"ppl-{name}-{kind}-{args.tokens}.json")
            log(f"{name} {kind}: ppl {row['ppl'][kind]}, {rec['tokens_per_s_median']:.1f} tokens/s "
                f"(1M tokens: {rec['projected_wall_h_1M_tokens']:.1f} h)")
            # share of the pruned -> dense perplexity gap closed, per held-out text
            row.setdefault("gap_closed", {})[kind] = {t: (row["ppl"]["pruned"][t] - row["ppl"][kind][t]) /
                                                      (row["ppl"]["pruned"][t] - dense[t]) for t in HELDOUT}
            if "distilled" in row["ppl"] and "lm_trained" in row["ppl"]:
                row["distill_beats_lm"] = {t: row["ppl"]["distilled"][t] < row["ppl"]["lm_trained"][t]
                                           for t in HELDOUT}
            result["rows"][name] = row  # written after every run: a partial row is a result too
            result["wall_s"] = time.perf_counter() - t0
            atomic_write_json(args.out, result)
    log(f"wrote {args.out}")
    for name, row in result["rows"].items():
        for kind in ("distilled", "lm_trained"):
            if kind in row:
                closed = ", ".join(f"{t} {row['gap_closed'][kind][t]:.0%}" for t in HELDOUT)
                print(f"{name:<14} {kind:<11} gap closed: {closed}")


if __name__ == "__main__":
    main()
