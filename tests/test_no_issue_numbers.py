"""Docs and code speak of the software, never of tracker issue numbers ("issue 19 §3" means nothing to a reader
of the docs or of a results file)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ISSUE = re.compile(r"\b[Ii]ssues?[ -]#?\d+|§ ?\d")


def _tracked_text() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "*.py", "*.md", "*.yaml", "*.toml"], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    # committed results keep the protocol strings they were written with; this file spells the pattern out
    return [p for p in out.splitlines()
            if not p.startswith("benchmarks/results/") and p != "tests/test_no_issue_numbers.py"]


def test_no_tracker_issue_numbers_in_docs_or_code():
    hits = [f"{p}:{n}: {line.strip()}" for p in _tracked_text() if (REPO / p).is_file()
            for n, line in enumerate((REPO / p).read_text(encoding="utf-8").splitlines(), 1)
            if ISSUE.search(line) and "github.com" not in line]
    assert hits == []


def test_the_pattern_finds_what_it_must():
    assert [bool(ISSUE.search(s)) for s in ("(issue 19 §3)", "issue-10 summary", "issues 4", "this issue",
                                            "tissue 3")] == [True, True, True, False, False]
