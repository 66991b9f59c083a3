"""The engine's decode step compiled with ``torch.compile`` (``rollout.compile_decode``), eager
where compiling is off or fails.

A decode step of a small model on a CPU is mostly not matmuls: eager PyTorch issues thousands of
small operations (norms, rotary, residual adds, the adapters' path, attention over the cache), each
through Python and the dispatcher. ``torch.compile`` (TorchDynamo capturing the decoder's forward,
inductor fusing its pointwise operations into generated C++ or Triton kernels) removes most of
that; the matmuls stay the same library calls.

What is compiled: one decode step of :class:`~lldslight.rollout.cache.Decoder`, every slot taking
one token: the 4-D mask, the decoder's forward (every layer, and the ragged cache's write of the new
keys and values, an ``index_put`` into its buffers) and the LM head. Prefills (a prompt, an
observation) stay eager: they run once per turn at ever different widths. The ragged cache keeps
its layout; :meth:`RaggedCache.prepare <lldslight.rollout.cache.RaggedCache.prepare>` resizes its
buffers before the step, outside the compiled region, so inside it only writes into them.

Shapes: compiled with ``dynamic=True``. Three sizes change during a rollout: the context length
(every step), the cache's capacity (grown geometrically) and the number of slots (the cache drops
finished rows). Static shapes would recompile at every step (the mask and attention span the
context) or, with a fixed-capacity cache over which attention always runs (transformers'
StaticCache, gpt-fast), at every capacity and slot count; symbolic sizes compile the step once
(once more for one slot: torch specialises a size of 1). What dynamo still guards on (the model's
structure, autocast, grad mode) is the same at every step and every rollout, so the one compiled
step serves every ``generate`` call of a run; the weights are inputs of the compiled graph, not
constants, so it follows every update.

Fallback: "auto" runs the step eagerly, for the rest of the process, from the first step
``torch.compile`` cannot make or run (no working compiler, an unsupported operation, a Python
torch.compile does not support), said once; the step that failed is run again eagerly (the cache
write is idempotent: the same values at the same positions). "on" raises instead, so a benchmark
never times eager under the compiled label.
"""
from __future__ import annotations

import time
from typing import Literal, Optional

import torch
from torch import Tensor

from lldslight.update.frozen_prefix import say_once

from .cache import Decoder

CompileDecode = Literal["off", "on", "auto"]

_compiled_step = None  # one torch.compile wrapper per process: every engine (training, evaluation) shares its compiled code


def compiled_step():
    """``decode_logits`` through ``torch.compile``, made at the first call."""
    global _compiled_step
    if _compiled_step is None:
        _compiled_step = torch.compile(decode_logits, dynamic=True)
    return _compiled_step


def decode_logits(decoder: Decoder, ids: Tensor, at: Tensor, kv_len: int) -> Tensor:
    """One decode step after ``decoder.cache.prepare(at, None, kv_len)``: ids, at [S, 1] ->
    float32 logits [S, V]. What is compiled; also the eager step."""
    return decoder.logits(decoder.forward_prepared(ids, at, kv_len)[:, -1])


class CompiledDecode:
    """The engine's decode step under ``rollout.compile_decode``: "off" (eager), "on" (compiled,
    a failure raises) or "auto" (compiled, eager from the first failure, said once).

    ``compiled_steps`` counts the steps the compiled function ran, ``first_step_s`` is the first
    one's wall time (it includes the compilation), ``failure`` says why "auto" went back to eager."""

    def __init__(self, mode: CompileDecode = "off") -> None:
        self.mode = mode
        self.failure: Optional[str] = None
        self.compiled_steps = 0
        self.first_step_s: Optional[float] = None

    @property
    def active(self) -> bool:
        return self.mode != "off" and self.failure is None

    def __call__(self, decoder: Decoder, ids: Tensor, at: Tensor, kv_len: int) -> Tensor:
        """ids, at: [S, 1], every slot; kv_len: one more than the largest position -> logits [S, V]."""
        decoder.cache.prepare(at, None, kv_len)
        if self.active:
            t0 = time.perf_counter()
            try:
                logits = compiled_step()(decoder, ids, at, kv_len)
            except Exception as err:  # any failure to compile or run the compiled step: eager takes over
                cause = f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:300]}"
                if self.mode == "on":
                    raise RuntimeError(f"rollout.compile_decode 'on': torch.compile could not compile or run the decode "
                                       f"step ({cause}); set it to 'auto' to fall back to eager, or 'off'") from err
                self.failure = cause
                say_once("compile_decode", f"rollout.compile_decode auto: the decode step runs eagerly, torch.compile failed ({cause})")
            else:
                if self.first_step_s is None:
                    self.first_step_s = time.perf_counter() - t0
                self.compiled_steps += 1
                return logits
        return decode_logits(decoder, ids, at, kv_len)
