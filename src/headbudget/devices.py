"""Which float type and which device a command runs with: ``--dtype`` / ``--device`` flags and the
``dtype=`` / ``device=`` model arguments, each a one-line ValueError naming the flag when wrong.

    >>> from headbudget.devices import resolve_device, resolve_dtype
    >>> resolve_dtype("bfloat16"), resolve_device("cpu")
    (torch.bfloat16, device(type='cpu'))
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

#: ``--dtype`` / ``dtype=`` values (lm-eval's hf backend takes the same names); "auto": the checkpoint's own
DTYPES: dict[str, torch.dtype | None] = {"auto": None, "float32": torch.float32,
                                         "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(value: str | torch.dtype | None, flag: str = "--dtype") -> torch.dtype | None:
    """The torch dtype of a ``--dtype`` flag or ``dtype=`` argument; None ("auto" or None): the checkpoint's.

        >>> resolve_dtype("bfloat16"), resolve_dtype("auto"), resolve_dtype(torch.float16)
        (torch.bfloat16, None, torch.float16)
    """
    if value is None or isinstance(value, torch.dtype):
        if value is not None and value not in DTYPES.values():
            raise ValueError(f"{flag} must be one of {', '.join(DTYPES)}, got {value}")
        return value
    name = str(value).strip().removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"{flag} must be one of {', '.join(DTYPES)}, got {value!r}")
    return DTYPES[name]


def resolve_device(device: str | torch.device | None, flag: str = "--device") -> torch.device:
    """``device`` when given (cpu, cuda, cuda:N), else cuda when available, else cpu.

        >>> resolve_device(None)          # on a machine with a GPU       # doctest: +SKIP
        device(type='cuda')
    """
    if device is None or str(device).strip() == "":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    text = str(device).strip()
    kind, _, index = text.partition(":")
    if kind not in ("cpu", "cuda") or (index and (kind == "cpu" or not index.isdigit())):
        raise ValueError(f"{flag} must be cpu, cuda or cuda:N, got {text!r}")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{flag} {text}: CUDA is not available on this machine (use --device cpu)")
    return torch.device(text)


@contextlib.contextmanager
def scoring_mode(model: torch.nn.Module) -> Iterator[None]:
    """``model`` scored: eval mode under ``torch.inference_mode()``, its training mode restored afterwards.

        >>> m = torch.nn.Dropout().train()
        >>> with scoring_mode(m):
        ...     m.training, torch.is_inference_mode_enabled()
        (False, True)
        >>> m.training
        True
    """
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            yield
    finally:
        model.train(was_training)


__all__ = ["DTYPES", "resolve_device", "resolve_dtype", "scoring_mode"]


# --------------------------------------------------------------------------- training precision
def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AMX tiles or AVX-512 BF16).  Without it torch emulates
    bf16: on an AVX2-only EPYC a bf16-autocast MiniLM step took 66-76 s against 4.6-5.2 s in fp32 (an AMX CPU
    ran SmolLM2 distillation 2.2x faster than fp32).  ``HEADBUDGET_CPU_BF16=0`` (or ``1``) overrides the
    probe, so ``auto`` means the same precision everywhere (the test suite sets 0: its numbers are fp32)."""
    forced = os.environ.get("HEADBUDGET_CPU_BF16", "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    if forced:
        raise ValueError(f"HEADBUDGET_CPU_BF16 must be 0 or 1, got {forced!r}")
    probes = [getattr(torch.cpu, n, None) for n in ("_is_amx_tile_supported", "_is_avx512_bf16_supported")]
    return any(bool(p()) for p in probes if p is not None)


def cpu_description() -> str:
    """The CPU a figure was measured on, e.g. ``'AMD EPYC (AVX512, 2 cores)'`` (model, torch's vector ISA,
    cores): losses can differ in their last bits between ISAs, and tokens/s a lot, so benchmarks keep it."""
    model = "unknown CPU"
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{model} ({torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} cores)"


def use_bf16_autocast(precision: str, device: torch.device, flag: str = "train.precision") -> bool:
    """Whether a training forward runs under bf16 autocast: ``bf16`` yes, ``fp32`` no, ``auto`` on CUDA and on
    CPUs with native bf16; an explicit ``bf16`` on a CPU without it warns (emulated, often 10x slower).

        >>> use_bf16_autocast("fp32", torch.device("cpu")), use_bf16_autocast("auto", torch.device("cuda"))
        (False, True)
    """
    if precision not in ("auto", "fp32", "bf16"):
        raise ValueError(f"{flag} must be auto, fp32 or bf16, got {precision!r}")
    if precision == "fp32":
        return False
    if device.type != "cpu":
        return precision == "bf16" or device.type == "cuda"
    native = cpu_has_native_bf16()
    if precision == "bf16" and not native:
        import warnings

        warnings.warn(f"{flag}=bf16 on a CPU without AMX or AVX-512 BF16: bf16 is emulated there and "
                      "usually several times slower than fp32 (auto picks fp32 on such CPUs)", stacklevel=2)
    return precision == "bf16" or native
