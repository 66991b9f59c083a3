"""The arithmetic a policy runs in (docs/precision.md): what bf16 this machine has, the precision
``auto`` resolves to, the dtypes of weights and adapters, and the autocast every forward runs under.
"""
from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from lldslight.policy.config import DType


def resolve_dtype(dtype: Optional[DType]) -> torch.dtype:
    """The torch dtype of a ``--dtype`` name ("auto" or None: bfloat16 on CUDA, float32 on CPU)."""
    if dtype in ("auto", None):
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


@dataclass(frozen=True)
class Bf16Support:
    """Whether a device multiplies bf16 natively (not emulated), and what that was judged from."""

    native: bool
    device: str  # "cpu" or "cuda"
    evidence: str  # the flags or the call that decided, for the start-up line


def cpu_bf16_support() -> Bf16Support:
    """Native bf16 matmuls on this CPU: AVX512-BF16 (vdpbf16ps) or AMX-BF16 tiles, through oneDNN.

    torch's own CPUID checks (``torch.cpu._is_avx512_bf16_supported``, ``_is_amx_tile_supported``:
    the cpuinfo library, which also checks the OS saves the AVX-512 / AMX register state) decide;
    /proc/cpuinfo's flags are the fallback where torch lacks them. Not ``torch.backends.cpu
    .get_cpu_capability()`` (it says "AVX512" for CPUs without bf16) nor
    ``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` (true on any AVX512 CPU, where oneDNN emulates
    bf16 and runs slower than fp32)."""
    found: dict[str, bool] = {}
    checks = {"avx512_bf16": "_is_avx512_bf16_supported", "amx_tile": "_is_amx_tile_supported"}
    for flag, name in checks.items():
        fn = getattr(torch.cpu, name, None)
        if callable(fn):
            with contextlib.suppress(Exception):
                found[flag] = bool(fn())
    source = "torch.cpu"
    if "avx512_bf16" not in found:
        flags = _proc_cpu_flags()
        found = {"avx512_bf16": "avx512_bf16" in flags, "amx_bf16": "amx_bf16" in flags}
        source = "/proc/cpuinfo"
    onednn = torch.backends.mkldnn.is_available()
    have = [f for f, ok in found.items() if ok]
    native = bool(have) and onednn
    evidence = f"{source}: {', '.join(have) if have else 'no ' + ' / '.join(found)}" + ("" if onednn else "; torch built without oneDNN")
    return Bf16Support(native, "cpu", evidence)


def _proc_cpu_field(*names: str) -> Optional[str]:
    """The first /proc/cpuinfo line starting with one of ``names``, its value (None off Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith(names)), None)


def _proc_cpu_flags() -> set[str]:
    return set((_proc_cpu_field("flags", "Features") or "").split())


def cpu_description() -> dict:
    """The CPU a figure was measured on, as benchmarks and lab runs record it: machines of one
    kind differ (AVX512-BF16 with or without AMX, AVX2 only), and a speed or a chaotic run holds on
    its own kind. The SIMD flags are the ones that decide kernels: avx*, amx*, fma, sse4*."""
    simd = sorted(f for f in _proc_cpu_flags() if f.startswith(("avx", "amx", "fma", "sse4")))
    return {"cpu_model": _proc_cpu_field("model name"), "cpu_flags_simd": simd,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_bf16": cpu_bf16_support().evidence}


def cuda_bf16_support() -> Bf16Support:
    native = bool(torch.cuda.is_bf16_supported(including_emulation=False))
    return Bf16Support(native, "cuda", f"torch.cuda.is_bf16_supported() = {native} on {torch.cuda.get_device_name()}")


def bf16_support() -> Bf16Support:
    """Of the device the policy will run on: the GPU when there is one (Lightning's "auto"), else the CPU."""
    return cuda_bf16_support() if torch.cuda.is_available() else cpu_bf16_support()


@dataclass(frozen=True)
class Arithmetic:
    """A resolved ``policy.precision``: what is stored and computed in which dtype."""

    precision: str  # fp32 | bf16-mixed | bf16-true
    frozen: torch.dtype  # weights that do not train (the LoRA base, the full fine-tuning reference)
    trainable: torch.dtype  # the weights the optimiser updates, and so its state
    autocast: Optional[torch.dtype]  # the forwards' compute dtype under torch.autocast; None = as stored
    reason: str

    @property
    def line(self) -> str:
        return f"lldslight: policy.precision {self.precision} ({self.reason})"


def resolve_precision(cfg: "PolicyConfig", support: Optional[Bf16Support] = None) -> Arithmetic:
    """``cfg.precision`` made concrete; "auto" asks :func:`bf16_support` (or takes ``support``)."""
    name, reason = cfg.precision, "set in the config"
    if name == "auto":
        support = support or bf16_support()
        if support.native:
            name, reason = "bf16-mixed", f"auto: native bf16 on this {support.device.upper()}, {support.evidence}"
        else:
            name, reason = "fp32", f"auto: no native bf16 on this {support.device.upper()} ({support.evidence}), and emulated bf16 is slower than fp32"
    if name == "fp32":
        return Arithmetic("fp32", torch.float32, torch.float32, None, reason)
    if name == "bf16-mixed":
        return Arithmetic("bf16-mixed", torch.bfloat16, torch.float32, torch.bfloat16, reason)
    return Arithmetic("bf16-true", torch.bfloat16, torch.bfloat16, None, reason)


_ANNOUNCED: set[str] = set()


def announce_precision(arith: Arithmetic) -> None:
    """The one start-up line saying which precision runs and why (once per process, rank 0 only)."""
    if arith.line in _ANNOUNCED or int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) or 0) != 0:
        return
    _ANNOUNCED.add(arith.line)
    print(arith.line, file=sys.stderr, flush=True)


def model_arithmetic(model: nn.Module) -> Optional[Arithmetic]:
    """The Arithmetic ``load_policy`` gave ``model`` (None for a model it did not build)."""
    return getattr(model, "_lldslight_arithmetic", None)


def precision_autocast(model: nn.Module) -> contextlib.AbstractContextManager:
    """The forward's autocast under bf16-mixed (a no-op otherwise): every forward of ``model``,
    sampler and trainer alike, runs inside it, so both compute the same arithmetic."""
    arith = model_arithmetic(model)
    if arith is None or arith.autocast is None:
        return contextlib.nullcontext()
    device = next(model.parameters()).device.type
    return torch.autocast(device_type=device, dtype=arith.autocast)


def export_dtype(cfg: "PolicyConfig") -> str:
    """The dtype an export saves by default: the one the policy trained in (bfloat16 for "auto")."""
    return "float32" if cfg.precision == "fp32" else "bfloat16"
