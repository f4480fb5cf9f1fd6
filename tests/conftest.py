"""Shared test fixtures: tiny models, the ../shared data folder (skipped when absent)."""

from __future__ import annotations

import os
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
