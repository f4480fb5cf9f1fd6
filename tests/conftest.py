"""Shared test fixtures: tiny models, the ../shared data folder (skipped when absent)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip("../shared/data is not present")
    return SHARED_DATA


# Tiny models run faster on one thread, and the suite stays fast when the machine is busy.
torch.set_num_threads(1)
# train.precision=auto means fp32 here on every CPU, AVX-512 BF16 / AMX ones included: the suite's reference
# numbers (DDP equals one process to 1e-5, ...) are fp32. Set in the environment so spawned ranks see it too.
os.environ["HEADBUDGET_CPU_BF16"] = "0"


@pytest.fixture(autouse=True)
def _seed_and_one_thread() -> Iterator[None]:
    """Every test starts from seed 0 on one thread (tiny models run fastest single-threaded on a shared CPU);
    a test or command that changes the thread count has it restored afterwards."""
    torch.manual_seed(0)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def load_benchmark(name: str):
    """Import ``benchmarks/<name>.py`` (not a package) as a module, for tests of a benchmark's pure parts."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _token(part: object) -> str:
    """A regex for ``part`` as a whole token: '4' does not match inside '14', '4.5' or '-4', 'layer 1' not in
    'layer 10', '--keep' not in '--keep-ratio', a path not as the start of a longer path."""
    text = str(part)
    pattern = re.escape(text)
    if re.match(r"\w", text):
        pattern = r"(?<![\w-])(?<!\d\.)" + pattern
    if re.search(r"\w$", text):
        pattern += r"(?![\w/-]|\.\d)" if "/" in text else r"(?![\w-]|\.\d)"
    return pattern


def names(*parts: object) -> str:
    """A ``pytest.raises(..., match=names(...))`` pattern: the message names every one of ``parts`` (paths, numbers,
    flags, field names...) as whole tokens, in any order. Error tests check the kind of error and the values its
    message must carry, not the wording of the sentence around them."""
    return r"\A" + "".join(rf"(?=[\s\S]*{_token(p)})" for p in parts)


def assert_names(text: str, *parts: object) -> None:
    """Assert ``text`` (a message, an error line) names every one of ``parts`` as whole tokens; see ``names``."""
    missing = [p for p in parts if not re.search(_token(p), text)]
    assert not missing, f"{missing} not named in {text!r}"


def error_line(err: str, command: str) -> str:
    """The one line a failed CLI command writes to stderr (``headbudget COMMAND: error: ...``, nothing else), so that a
    test can check the values it names with ``assert_names``."""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"headbudget {command}: error: "), err
    return lines[0]
