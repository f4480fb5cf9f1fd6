"""train.precision=auto picks bf16 autocast only where the hardware runs bf16 natively."""

import pytest
import torch

from conftest import names
from headbudget import devices
from headbudget.devices import use_bf16_autocast

CPU = torch.device("cpu")


@pytest.mark.parametrize("native", [True, False])
def test_auto_on_cpu_follows_native_bf16(monkeypatch, native):
    monkeypatch.setattr(devices, "cpu_has_native_bf16", lambda: native)
    assert use_bf16_autocast("auto", CPU) is native


def test_explicit_settings_are_honoured_and_emulated_bf16_warns(monkeypatch):
    monkeypatch.setattr(devices, "cpu_has_native_bf16", lambda: False)
    assert use_bf16_autocast("fp32", CPU) is False
    with pytest.warns(UserWarning, match="train.precision=bf16 on a CPU without AMX"):
        assert use_bf16_autocast("bf16", CPU) is True
    assert use_bf16_autocast("auto", torch.device("cuda")) is True
    assert use_bf16_autocast("auto", torch.device("meta")) is False


def test_a_bad_precision_names_the_flag():
    with pytest.raises(ValueError, match=names("train.precision", "auto", "fp32", "bf16", "'fp16'")):
        use_bf16_autocast("fp16", CPU)


def test_native_probe_reads_torch_cpu_capabilities(monkeypatch):
    monkeypatch.delenv("HEADBUDGET_CPU_BF16")  # conftest pins it to 0
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True, raising=False)
    assert devices.cpu_has_native_bf16() is True
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    assert devices.cpu_has_native_bf16() is False


def test_the_environment_overrides_the_probe(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True, raising=False)
    monkeypatch.setenv("HEADBUDGET_CPU_BF16", "0")
    assert devices.cpu_has_native_bf16() is False and use_bf16_autocast("auto", CPU) is False
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    monkeypatch.setenv("HEADBUDGET_CPU_BF16", "1")
    assert devices.cpu_has_native_bf16() is True
    monkeypatch.setenv("HEADBUDGET_CPU_BF16", "yes")
    with pytest.raises(ValueError, match=names("HEADBUDGET_CPU_BF16", "0", "1", "'yes'")):
        devices.cpu_has_native_bf16()


def test_the_trainer_asks_the_precision_policy_with_its_setting_and_device(monkeypatch, tmp_path):
    """The trainer decides autocast through the policy (before: its own rule, auto = fp32 on every CPU)."""
    from headbudget.train import trainer as trainer_mod

    seen = []
    monkeypatch.setattr(trainer_mod, "use_bf16_autocast", lambda p, d: seen.append((p, d.type)) or False)
    from headbudget.train.config import RunConfig

    cfg = RunConfig.from_dict({"model": {"preset": "cpu-tiny", "schedule": "uniform"},
                               "data": {"source": "synthetic:20000", "tokenizer": "byte"},
                               "train": {"steps": 1, "batch_size": 2, "context": 16, "eval_every": 0,
                                         "device": "cpu", "threads": 1}})
    trainer_mod.Trainer(cfg, tmp_path / "run").run()
    assert seen == [("auto", "cpu")]


def test_cpu_description_names_model_isa_and_cores(tmp_path, monkeypatch):
    import builtins
    import os

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Test CPU 9000\nflags\t\t: fpu\n")
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda f, *a, **k: real_open(cpuinfo if f == "/proc/cpuinfo" else f, *a, **k))
    isa = torch.backends.cpu.get_cpu_capability()
    assert devices.cpu_description() == f"Test CPU 9000 ({isa}, {os.cpu_count()} cores)"
    monkeypatch.setattr(builtins, "open", lambda *a, **k: (_ for _ in ()).throw(OSError("no /proc")))
    assert devices.cpu_description() == f"unknown CPU ({isa}, {os.cpu_count()} cores)"
