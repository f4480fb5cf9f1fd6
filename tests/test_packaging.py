"""Packaging and start-up: the wheel ships the named configs, light modules stay light, and
``import headbudget`` + ``AutoModelForCausalLM.from_pretrained`` still works without an eager transformers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
CONFIG_NAMES = {"quickstart", "cpu-small", "gpt2-124m", "gpt2-354m", "gpt-757m"}


def _python(code: str, cwd: Path | None = None, env: dict | None = None) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=cwd, env=dict(os.environ, **(env or {})))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_light_modules_and_the_schedule_command_import_no_torch():
    out = _python(
        "import sys\n"
        "import headbudget, headbudget.schedules, headbudget.accounting, headbudget.budget\n"
        "import headbudget.train.config\n"
        "from headbudget.cli.main import main\n"
        "assert main(['schedule', '--preset', 'gpt2-124m', '--kind', 'prism', '--json']) == 0\n"
        "print(sorted(m for m in ('torch', 'transformers', 'numpy', 'sklearn') if m in sys.modules))\n")
    *printed, heavy = out.strip().splitlines()
    assert heavy == "[]"
    assert json.loads("\n".join(printed))["layers"][0]["n_heads"] == 3  # and it answered


def _tiny_model_dir(tmp_path: Path) -> tuple[Path, torch.Tensor, torch.Tensor]:
    from headbudget.models import HeadBudgetConfig, HeadBudgetForCausalLM

    model = HeadBudgetForCausalLM(HeadBudgetConfig.from_preset("cpu-tiny", schedule="prism", vocab_size=64)).eval()
    model.save_pretrained(str(tmp_path / "m"))
    x = torch.arange(12).reshape(2, 6)
    with torch.no_grad():
        return tmp_path / "m", x, model(x).logits


@pytest.mark.parametrize("order", ["headbudget first", "transformers first"])
def test_automodel_loads_after_import_headbudget(tmp_path, order):
    path, x, logits = _tiny_model_dir(tmp_path)
    torch.save({"x": x}, tmp_path / "x.pt")
    first, second = ("headbudget", "transformers") if order == "headbudget first" else ("transformers", "headbudget")
    out = _python(
        "import sys, torch\n"
        f"import {first}\n"
        "eager = 'transformers' in sys.modules\n"
        f"import {second}\n"
        "from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(path)!r}).eval()\n"
        f"x = torch.load({str(tmp_path / 'x.pt')!r}, weights_only=True)['x']\n"
        "with torch.no_grad():\n"
        f"    torch.save(m(x).logits, {str(tmp_path / 'out.pt')!r})\n"
        "print(eager, type(m).__name__, type(m).__module__)\n")
    eager, cls, module = out.split()
    assert cls == "HeadBudgetForCausalLM" and module.startswith("headbudget.")
    if order == "headbudget first":
        assert eager == "False"  # import headbudget did not load transformers
    assert torch.equal(torch.load(tmp_path / "out.pt", weights_only=True), logits)


def test_wheel_ships_the_named_configs(tmp_path):
    src = tmp_path / "src"  # build from a copy: the shared checkout's build/ and egg-info stay untouched
    shutil.copytree(REPO / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / f, src / f)
    wheel_dir = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(wheel_dir), str(src)], check=True, capture_output=True, timeout=300)
    (wheel,) = wheel_dir.glob("headbudget-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"headbudget/configs/{n}.yaml" for n in CONFIG_NAMES} <= names
    assert "headbudget/py.typed" in names
    # installed from the wheel, run from a directory without configs/: names and README paths resolve
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    work = tmp_path / "elsewhere"
    work.mkdir()
    out = _python(
        "from headbudget.train.config import bundled_configs, load_config, resolve_config_path\n"
        "import json; print(json.dumps(sorted(bundled_configs())))\n"
        "print(resolve_config_path('cpu-small'))\n"
        "print(load_config(resolve_config_path('configs/gpt2-124m.yaml')).model.preset)\n",
        cwd=work, env={"PYTHONPATH": str(target)})
    names_line, path_line, preset = out.strip().splitlines()
    assert set(json.loads(names_line)) == CONFIG_NAMES
    assert Path(path_line).is_relative_to(target) and preset == "gpt2-124m"
