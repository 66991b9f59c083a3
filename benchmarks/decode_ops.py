"""A bf16 decode step before and after two changes, measured side by side in one process.

    python benchmarks/decode_ops.py --json benchmarks/results/decode_ops.json
    python benchmarks/decode_ops.py --precision fp32 --threads 2
    python benchmarks/decode_ops.py --sides current --rows 32 --bounds   # the library against its limits
    python benchmarks/decode_ops.py --sides peft-forward current --rows 32 --bounds
    python benchmarks/decode_ops.py --sides current compiled --rows 32 --bounds   # rollout.compile_decode

The first two changes (2026-12-02), both exact (the same tensors come out):

- the ragged KV cache writes new keys and values with ``index_put`` instead of ``scatter_``
  (lldslight/rollout/cache.py): on this CPU torch 2.13's bf16 ``scatter_`` is far slower than
  fp32's at the decode shape;
- under ``bf16-mixed`` peft no longer casts each adapted layer's input to fp32 (autocast casts it
  straight back at the adapter's matmul; lldslight/policy/load.py sets peft's ``cast_input_dtype_enabled``
  off).

The third (2026-12-05), exact too: while sampling, each LoRA Linear runs peft's operations without
peft's per-call bookkeeping (lldslight/policy/lora_forward.py).

"compiled" is the library with ``rollout.compile_decode: on`` (lldslight/rollout/compiled.py: the
decode step through torch.compile); its warm-up step's wall time, which includes the compilation,
is reported as ``compile_s`` (benchmarks/compiled_decode.py runs the grid of rows, threads and
precisions). "previous" puts all three back (a cache that writes with ``scatter_``, peft's casts on, peft's
forward); "peft-forward" puts back only the third; "current" is the library as it is. The report's
ratio is current over the other side. Both decode the same random tokens from the same prefilled cache:
SmolLM2-135M-Instruct with LoRA r=16 on every linear layer (as benchmarks/step.py), ``--rows`` rows
at ``--context`` tokens of context, ``--steps`` 1-token steps per run, under the sampler's
``sampling_weights`` (autocast, the adapter path). The cache-write table times one layer's write
of one token per row, per dtype, on its own. Runs alternate (benchmarks/harness.py: load recorded,
busy runs repeated, medians [min-max]).

``--bounds`` also reports the "current" decode step against the machine (benchmarks/bounds.py,
measured in the same process at the same rows and threads): the physical limit (every weight read
once at the measured read bandwidth, or the FLOPs at the large-shape matmul peak, whichever is
larger), the model's Linears alone at these rows (what an eager step cannot beat with these
kernels), and the LoRA adapters' rank-r matmuls alone (two per adapted Linear, in the step's
dtype): the part of the step outside all matmuls is what fusion or compilation could remove.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import time
from unittest import mock
from pathlib import Path

if __package__:
    from . import bounds, harness
else:
    import bounds
    import harness


def cache_write_us(dtype, rows: int, kv_heads: int, head_dim: int, capacity: int, repeats: int = 400) -> dict[str, float]:
    """Microseconds per call of each way to write one token per row into a [rows, kv_heads, capacity, head_dim] buffer."""
    import torch

    buf = torch.zeros(rows, kv_heads, capacity, head_dim, dtype=dtype)
    new = torch.randn(rows, kv_heads, 1, head_dim).to(dtype)  # [rows, kv_heads, 1, head_dim]
    at = torch.full((rows, 1), capacity // 2)
    index = at[:, None, :, None].expand(new.shape)
    slots = torch.arange(rows)

    def scatter():
        buf.scatter_(2, index, new)

    def index_put():
        buf[slots[:, None], :, at] = new.transpose(1, 2)

    out = {}
    for name, fn in (("scatter_", scatter), ("index_put", index_put)):
        for _ in range(20):
            fn()
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        out[name] = (time.perf_counter() - t0) / repeats * 1e6
    scatter(), index_put()  # the same element written both ways: identical buffers
    return out


def previous_cache_class():
    """The cache as it was: ``scatter_`` when every slot takes part."""
    from lldslight.rollout import RaggedCache

    class ScatterCache(RaggedCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            if self.rows is not None:
                return super().update(key_states, value_states, layer_idx, *args, **kwargs)
            k, v = self.buffers(key_states, value_states, layer_idx)
            index = self.at[:, None, :, None].expand(key_states.shape)  # [S, kv_heads, q, head_dim]
            k.scatter_(2, index, key_states)
            v.scatter_(2, index, value_states)
            return k[:, :, : self.kv_len], v[:, :, : self.kv_len]

    return ScatterCache


def adapter_matmuls_s(shape, rows: int, r: int, threads: int, precision: str, repeats: int = 3) -> float:
    """The LoRA adapters' matmuls alone in one decode step: x A^T [rows, r] then (x A^T) B^T for
    every Linear of every layer (random weights of their shapes, in the step's compute dtype)."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    dtype = bounds.torch_dtype(precision)
    pairs = [(torch.randn(r, a, dtype=dtype), torch.randn(b, r, dtype=dtype)) for _ in range(shape.layers) for a, b in shape.linears()]
    xs = {a: torch.randn(rows, a, dtype=dtype) for a, _ in shape.linears()}

    def run():
        for a, b in pairs:
            F.linear(F.linear(xs[a.shape[1]], a), b)
    return bounds.best_of(run, repeats)


def against_bounds(step_ms: float, shape, rows: int, context: float, m: dict, compute: str, adapters_ms: float) -> dict:
    """A decode step of ``step_ms`` computing in ``compute`` ("fp32" or "bf16") as fractions of the
    limits in ``m`` (bounds.measure at the same rows and threads), with ``adapters_ms`` of LoRA
    matmuls alone: pure arithmetic."""
    dec = bounds.decode_bound_s(shape, rows, context, bounds.read_gbs(m), bounds.gemm_rates(m, compute)["square_2048"],
                                bounds.DTYPE_BYTES[compute])
    linears_ms = bounds.decode_matmuls_of(m, compute) * 1e3
    return {"decode_step_ms": step_ms, "bound_ms": dec["bound_s"] * 1e3, "memory_bound_ms": dec["memory_s"] * 1e3,
            "compute_bound_ms": dec["compute_s"] * 1e3, "linears_alone_ms": linears_ms, "adapter_matmuls_alone_ms": adapters_ms,
            "fraction_of_bound": dec["bound_s"] * 1e3 / step_ms, "outside_matmuls_ms": step_ms - linears_ms - adapters_ms}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--precision", default="bf16-mixed", choices=["fp32", "bf16-mixed"])
    p.add_argument("--rows", type=int, default=8, help="decode batch (benchmarks/step.py: 2 prompts x G=4)")
    p.add_argument("--context", type=int, default=200, help="tokens already in each row's cache")
    p.add_argument("--steps", type=int, default=32, help="1-token decode steps per timed run")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sides", nargs="+", default=["previous", "current"], choices=["previous", "peft-forward", "current", "compiled"])
    p.add_argument("--bounds", action="store_true", help="also measure the machine's limits and report the current side against them")
    p.add_argument("--json", default=None)
    harness.add_arguments(p)
    args = p.parse_args(argv)
    import torch
    from peft.tuners.tuners_utils import BaseTunerLayer

    from lldslight.policy import lora_forward
    from lldslight.policy import LoRAConfig, PolicyConfig, cpu_description, load_policy, sampling_weights
    from lldslight.rollout import CompiledDecode, Decoder

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model, _ = load_policy(PolicyConfig(precision=args.precision, lora=LoRAConfig(r=16, alpha=32)))
    model.eval()
    adapted = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    current_casts = adapted[0].cast_input_dtype_enabled
    cfg = model.config
    S, P = args.rows, args.context
    prompt = torch.randint(100, cfg.vocab_size - 100, (S, P))  # [S, P]
    fed = torch.randint(100, cfg.vocab_size - 100, (args.steps, S, 1))  # [steps, S, 1]
    ScatterCache = previous_cache_class()

    def peft_forward():
        """The sampler with peft's own LoRA forward: lora_forward refuses every layer."""
        return mock.patch.object(lora_forward, "lean_forward", lambda layer: None)

    compiled = CompiledDecode("on")  # one per process: compiled once, at the first warm-up step

    def decode(side: str) -> tuple[dict, "torch.Tensor"]:
        for layer in adapted:
            layer.cast_input_dtype_enabled = True if side == "previous" else current_casts
        dec = Decoder(model)
        if side == "previous":
            dec.cache = ScatterCache()
        with torch.no_grad(), peft_forward() if side != "current" else contextlib.nullcontext(), sampling_weights(model):
            dec(prompt, torch.arange(P).expand(S, P), P)
            t0 = time.perf_counter()
            for t in range(args.steps):
                if side == "compiled":
                    logits = compiled(dec, fed[t], torch.full((S, 1), P + t), P + t + 1)  # [S, V]
                else:
                    logits = dec.logits(dec(fed[t], torch.full((S, 1), P + t), P + t + 1)[:, -1])  # [S, V]
            wall = time.perf_counter() - t0
        return {"ms_per_step": wall / args.steps * 1e3, "steps": args.steps}, logits

    warm = {side: decode(side)[1] for side in args.sides}  # warm-up, and each side's outputs against current's
    compile_s = compiled.first_step_s  # None unless the compiled side ran
    others = [side for side in args.sides if side != "current"] if "current" in args.sides else []
    max_diff = {side: (warm[side] - warm["current"]).abs().max().item() for side in others}

    def run(side):
        with harness.LoadMeter() as m:
            figures, _ = decode(side)
        return figures, m.record

    policy = harness.policy_from_args(args)
    attempts = harness.alternate(args.sides, run, args.rounds, policy,
                                 describe=lambda side, m: f"{m['ms_per_step']:.1f} ms/step;")
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = cfg.hidden_size // heads
    writes = {str(dt).replace("torch.", ""): cache_write_us(dt, S, kv_heads, head_dim, P + 64) for dt in (torch.float32, torch.bfloat16)}
    report = {
        "config": {k: getattr(args, k) for k in ("precision", "rows", "context", "steps", "rounds", "threads", "seed", "sides")}
                  | {"model": "SmolLM2-135M-Instruct", "lora": "r=16 on every linear layer", "torch": torch.__version__},
        "cpu": cpu_description(),
        "sides": {s: harness.side_summary(attempts, s, ["ms_per_step"]) for s in args.sides},
        "max_abs_logit_difference": max_diff,
        "compile_s": compile_s,
        "cache_write_us": writes,
        "quiet": harness.quiet_summary(attempts, policy),
        "attempts": [a.to_dict() for a in attempts],
    }
    print(f"\nDecode step, SmolLM2-135M-Instruct {args.precision} + LoRA r=16 (every linear), {S} rows at {P} tokens of context, "
          f"{args.threads} thread(s); medians [min-max] of {args.rounds} alternating rounds of {args.steps} steps")
    print("| side | ms per decode step |\n|---|---|")
    labels = {"previous": "previous (scatter_ cache writes, peft input casts, peft's LoRA forward)",
              "peft-forward": "peft-forward (peft's LoRA forward)", "current": "current",
              "compiled": "compiled (rollout.compile_decode: on)"}
    for side in args.sides:
        print(f"| {labels[side]} | {harness.fmt_spread(report['sides'][side]['ms_per_step'], '{:.1f}')} |")
    report["ratios"] = {}
    for side in others:
        r = report["ratios"][side] = harness.ratio_summary(attempts, "current", side, "ms_per_step")
        print(f"current / {side}: {r['ratio_of_medians']:.2f} (per round {r['spread']['min']:.2f}-{r['spread']['max']:.2f}); "
              f"largest logit difference after {args.steps} steps: {max_diff[side]:.3g}")
    if compile_s is not None:
        print(f"compiled: the first step (compiling the decode step) took {compile_s:.1f} s")
    if args.bounds and {"current", "compiled"} & set(args.sides):
        shape, compute = bounds.Shape.from_config(cfg), "fp32" if args.precision == "fp32" else "bf16"
        with harness.LoadMeter() as meter:
            machine = bounds.measure(args.threads, shape, S)
            adapters_ms = adapter_matmuls_s(shape, S, 16, args.threads, compute) * 1e3
        report["machine"], report["bounds_load"] = machine, meter.record.to_dict()
        for side in ("current", "compiled"):
            if side not in args.sides:
                continue
            b = against_bounds(report["sides"][side]["ms_per_step"]["median"], shape, S, P, machine, compute, adapters_ms)
            report["bounds" if side == "current" else "bounds_compiled"] = b
            print(f"{side} vs this machine: physical limit {b['bound_ms']:.1f} ms (memory {b['memory_bound_ms']:.1f}, FLOPs "
                  f"{b['compute_bound_ms']:.1f}) = {b['fraction_of_bound']:.0%} of it; the Linears alone {b['linears_alone_ms']:.1f} ms, "
                  f"the adapters' matmuls alone {b['adapter_matmuls_alone_ms']:.1f} ms, outside all matmuls {b['outside_matmuls_ms']:.1f} ms")
    print("\n| cache write, one layer, one token per row (us per call) | scatter_ | index_put |\n|---|---|---|")
    for dt, w in writes.items():
        print(f"| {dt} | {w['scatter_']:.1f} | {w['index_put']:.1f} |")
    print(harness.quiet_line(report["quiet"]))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
