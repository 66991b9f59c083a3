"""What this CPU allows: memory bandwidth, the fp32 (sgemm) and bf16 matmul ceilings, and from them
lower bounds on a decode step and on the GRPO update in each precision, so step times can be
reported as fractions.

    python benchmarks/bounds.py --json bounds.json          # 1 and 2 threads, ~20 s each
    python benchmarks/bounds.py --threads 1 --mb 512

Measured (best of ``--repeats``: a ceiling is the best the machine does, not its typical run):
- read and copy bandwidth (GB/s) with torch (``x.sum()``, ``y.copy_(x)``) and numpy (the same,
  split over Python threads for 2 threads), on arrays far larger than the caches; a copy moves
  twice its size;
- sgemm GFLOP/s for a large square, and for the decode step's shapes ([rows x 576] @ [576 x 1536]
  and the vocabulary projection for SmolLM2-135M) and a training micro-batch's; the same shapes in
  bf16 (``bf16_gemm_gflops``; oneDNN's native kernels where the CPU has AVX512-BF16 / AMX, emulated
  and slower than fp32 where it has not: ``cpu_bf16`` says which);
- the decode step's matmuls alone, fp32 and bf16 weights: every Linear of the model (random weights
  of its shapes, so they stream from memory as the real ones do) applied once to ``rows`` rows:
  what an eager decode step cannot beat with these kernels.

Bounds (pure arithmetic, tested on hand-worked numbers):
- a decode step reads every weight once: time >= weight bytes / read bandwidth, and >= its FLOPs /
  the sgemm ceiling; the larger is the bound;
- the update's FLOPs (forward + backward over the step's tokens; backward through frozen weights
  computes input gradients only; gradient checkpointing re-runs the forward of every layer the
  backward passes) divided by the ceiling.

Per precision (``step_fractions(..., precision=)``), two references for each phase: the physical
limit (bandwidth, and the large-shape peak of that dtype) and what the BLAS achieves at the actual
shapes (the decode step's matmuls alone; the update's FLOPs at the training shape's rate); each
reported as bound / achieved, a fraction <= 1 (a bf16 decode step reads 2 bytes per weight).
"""
from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

if __package__:  # benchmarks.bounds: imported (tests, step.py), or run as python -m benchmarks.bounds
    from .harness import LoadMeter
else:  # python benchmarks/bounds.py: the script's own folder is on sys.path
    from harness import LoadMeter

# -- arithmetic -----------------------------------------------------------------------------------


@dataclass
class Shape:
    """A Llama-style decoder-only LM (q/k/v/o, gated MLP, RMSNorm), as the bounds see it."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    head_dim: Optional[int] = None
    tied: bool = True

    @classmethod
    def from_config(cls, cfg: Any) -> "Shape":
        return cls(hidden=cfg.hidden_size, intermediate=cfg.intermediate_size, layers=cfg.num_hidden_layers,
                   heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads, vocab=cfg.vocab_size,
                   head_dim=getattr(cfg, "head_dim", None), tied=bool(getattr(cfg, "tie_word_embeddings", False)))

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden // self.heads

    def linears(self) -> list[tuple[int, int]]:
        """(in, out) of one layer's Linears: q, k, v, o, gate, up, down."""
        h, q, kv, i = self.hidden, self.heads * self.hd, self.kv_heads * self.hd, self.intermediate
        return [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]

    def layer_params(self) -> int:
        return sum(a * b for a, b in self.linears())

    def params(self) -> int:
        """All parameters (the tied embedding counted once): 134,515,008 for SmolLM2-135M."""
        embed = self.vocab * self.hidden * (1 if self.tied else 2)
        norms = (2 * self.layers + 1) * self.hidden
        return self.layers * self.layer_params() + embed + norms

    def decode_bytes(self, dtype_bytes: int = 4) -> int:
        """Bytes of weights one decode step must read: every layer, the norms and the vocabulary
        projection (the embedding lookup reads a few rows only; tied, it is the projection)."""
        return dtype_bytes * (self.layers * self.layer_params() + (2 * self.layers + 1) * self.hidden + self.vocab * self.hidden)

    def attn_flops(self, positions: float) -> float:
        """QK^T and AV for one layer, summed over ``positions`` (query x key pairs): 4 * q_dim each."""
        return 4.0 * self.heads * self.hd * positions

    def decode_flops(self, rows: int, context: float) -> float:
        """One decode step: ``rows`` new tokens, each attending to ``context`` earlier ones."""
        per_token = 2.0 * (self.layers * self.layer_params() + self.vocab * self.hidden) + self.layers * self.attn_flops(context)
        return rows * per_token

    def prefill_flops(self, rows: int, length: int) -> float:
        """Prompt prefill: every position through the layers, the vocabulary only at the last."""
        causal_pairs = length * (length + 1) / 2
        return rows * (2.0 * length * self.layers * self.layer_params() + self.layers * self.attn_flops(causal_pairs)
                       + 2.0 * self.vocab * self.hidden)

    def lora_flops_per_token(self, r: int) -> float:
        """One layer's LoRA adapters on all its Linears, forward: x A (in x r) then B (r x out)."""
        return 2.0 * r * sum(a + b for a, b in self.linears())


def update_flops(shape: Shape, lengths: list[int], loss_tokens: int, *, lora_r: Optional[int] = 16,
                 lora_layers: Optional[int] = None, checkpointing: bool = True, head_recompute: bool = False) -> dict[str, float]:
    """FLOPs of one update (forward + backward) over rows of ``lengths`` real tokens each, with the
    vocabulary projection on ``loss_tokens`` positions (padding not counted: useful work only).

    ``lora_r=None``: full fine-tuning (weight gradients too). ``lora_layers``: LoRA on the top that
    many layers only (None = all): backward stops below them. ``checkpointing``: the forward of
    every layer backward passes is run again. ``head_recompute``: so is the vocabulary projection
    (a checkpointed log-prob chunk; neither lldslight's fused log-prob nor TRL recomputes it).
    """
    tokens = float(sum(lengths))
    pairs = float(sum(t * (t + 1) / 2 for t in lengths))
    L = shape.layers
    full = lora_r is None
    adapted = L if (full or lora_layers is None) else min(lora_layers, L)
    linear = 2.0 * shape.layer_params() * tokens  # one layer's Linears, forward
    attn = shape.attn_flops(pairs)  # one layer's attention, forward
    lora = 0.0 if full else shape.lora_flops_per_token(lora_r) * tokens
    head = 2.0 * shape.hidden * shape.vocab * loss_tokens
    forward = L * (linear + attn) + adapted * lora + head
    # Backward through a layer: input gradients (1x its Linears' forward; attention ~2x), the
    # adapters' input and weight gradients (2x theirs), and with full fine-tuning weight gradients.
    layer_bwd = linear + 2.0 * attn + 2.0 * lora + (linear if full else 0.0)
    head_bwd = head * (2.0 if full else 1.0)
    backward = adapted * layer_bwd + head_bwd
    recompute = (adapted * (linear + attn + lora) if checkpointing else 0.0) + (head if head_recompute else 0.0)
    return {"forward": forward, "backward": backward, "recompute": recompute, "total": forward + backward + recompute}


def decode_bound_s(shape: Shape, rows: int, context: float, read_gbs: float, sgemm_gflops: float, dtype_bytes: int = 4) -> dict[str, float]:
    """Lower bounds on one decode step's time: by memory (weights read once) and by compute."""
    mem = shape.decode_bytes(dtype_bytes) / (read_gbs * 1e9)
    compute = shape.decode_flops(rows, context) / (sgemm_gflops * 1e9)
    return {"memory_s": mem, "compute_s": compute, "bound_s": max(mem, compute)}


# -- measurements -----------------------------------------------------------------------------------


def best_of(fn, repeats: int) -> float:
    fn()  # warm-up: first touch of the pages, thread pool start
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bandwidth(threads: int, mb: int = 256, repeats: int = 5) -> dict[str, float]:
    """Read and copy GB/s with torch and numpy on ``mb`` MiB of fp32."""
    import numpy as np
    import torch

    torch.set_num_threads(threads)
    n = mb * 2**20 // 4
    x = torch.rand(n)
    y = torch.empty_like(x)
    nbytes = x.numel() * 4
    out = {
        "torch_read_gbs": nbytes / best_of(lambda: x.sum(), repeats) / 1e9,
        "torch_copy_gbs": 2 * nbytes / best_of(lambda: y.copy_(x), repeats) / 1e9,
    }
    a, b = x.numpy(), y.numpy()
    cuts = [i * n // threads for i in range(threads + 1)]
    parts = [(a[lo:hi], b[lo:hi]) for lo, hi in zip(cuts, cuts[1:])]
    with ThreadPoolExecutor(threads) as pool:  # numpy's sum and copyto release the GIL on large arrays
        out["numpy_read_gbs"] = nbytes / best_of(lambda: list(pool.map(lambda p: p[0].sum(), parts)), repeats) / 1e9
        out["numpy_copy_gbs"] = 2 * nbytes / best_of(lambda: list(pool.map(lambda p: np.copyto(p[1], p[0]), parts)), repeats) / 1e9
    return out


DTYPE_BYTES = {"fp32": 4, "bf16": 2}


def sgemm_gflops(threads: int, m: int, k: int, n: int, repeats: int = 5, precision: str = "fp32") -> float:
    """[m x k] @ [k x n] GFLOP/s in ``precision`` ("fp32" or "bf16"), best of ``repeats``. For small
    shapes the operands stay in cache: this is the kernel's ceiling, not a decode step's (see
    decode_matmuls_s)."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    dtype = torch_dtype(precision)
    a, w = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)  # an nn.Linear's layout: weight [out, in]
    calls = max(1, int(2e8 // (2 * m * k * n)))  # ~0.2 GFLOP per timing: above timer resolution

    def run():
        for _ in range(calls):
            F.linear(a, w)
    return 2.0 * m * k * n * calls / best_of(run, repeats) / 1e9


def torch_dtype(precision: str):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]


def decode_matmuls_s(shape: Shape, rows: int, threads: int, repeats: int = 3, precision: str = "fp32") -> float:
    """One decode step's matmuls alone: every Linear of ``shape`` (random weights of its shapes in
    ``precision``, so they stream from memory) applied to ``rows`` rows, plus the vocabulary projection."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    dtype = torch_dtype(precision)
    weights = [torch.randn(b, a, dtype=dtype) for _ in range(shape.layers) for a, b in shape.linears()]
    weights.append(torch.randn(shape.vocab, shape.hidden, dtype=dtype))
    xs = {a: torch.randn(rows, a, dtype=dtype) for a, _ in shape.linears()}

    def run():
        for w in weights:
            F.linear(xs[w.shape[1]], w)
    t = best_of(run, repeats)
    del weights
    return t


def measure(threads: int, shape: Shape, rows: int, train_rows: int = 512, mb: int = 256, repeats: int = 5) -> dict[str, Any]:
    """Every ceiling at ``threads``, with the load around the measurement."""
    from lldslight.policy import cpu_bf16_support

    h, i = shape.hidden, shape.intermediate
    shapes = {
        "square_2048": (2048, 2048, 2048),
        f"decode_{rows}x{h}x{i}": (rows, h, i),
        f"head_{rows}x{h}x{shape.vocab}": (rows, h, shape.vocab),
        f"train_{train_rows}x{h}x{i}": (train_rows, h, i),
    }
    with LoadMeter() as meter:
        bw = bandwidth(threads, mb, repeats)
        sg = {name: sgemm_gflops(threads, *mkn, repeats) for name, mkn in shapes.items()}
        chain = decode_matmuls_s(shape, rows, threads)
        bf = {name: sgemm_gflops(threads, *mkn, repeats, precision="bf16") for name, mkn in shapes.items()}
        chain_bf16 = decode_matmuls_s(shape, rows, threads, precision="bf16")
    support = cpu_bf16_support()
    return {"threads": threads, "rows": rows, **bw, "sgemm_gflops": sg, "decode_matmuls_s": chain,
            "decode_matmuls_gbs": shape.decode_bytes() / chain / 1e9,
            "bf16_gemm_gflops": bf, "decode_matmuls_bf16_s": chain_bf16,
            "decode_matmuls_bf16_gbs": shape.decode_bytes(2) / chain_bf16 / 1e9,
            "cpu_bf16": {"native": support.native, "evidence": support.evidence},
            "shape": asdict(shape), "load": meter.record.to_dict()}


def gemm_rates(m: dict[str, Any], precision: str) -> dict[str, float]:
    """The measured GFLOP/s of ``precision``'s matmuls at each shape measure() timed."""
    return m["sgemm_gflops"] if precision == "fp32" else m["bf16_gemm_gflops"]


def decode_matmuls_of(m: dict[str, Any], precision: str) -> float:
    return m["decode_matmuls_s"] if precision == "fp32" else m["decode_matmuls_bf16_s"]


def read_gbs(m: dict[str, Any]) -> float:
    """The read bandwidth a decode step can hope for: the best of torch's and numpy's."""
    return max(m["torch_read_gbs"], m["numpy_read_gbs"])


def step_fractions(m: dict[str, Any], shape: Shape, step: dict[str, float], lora_r: int, head_recompute: bool,
                   checkpointing: bool = True, precision: str = "fp32") -> dict[str, Any]:
    """Achieved / bound for one side's median step: generation (per decode step) and the update
    (with its decoder layers recomputed, or not: ``checkpointing``), against the physical limit of
    ``precision`` (bandwidth for its weight bytes, its large-shape matmul peak) and against what its
    BLAS achieves at the actual shapes (the decode step's matmuls alone; the update's FLOPs at the
    training-shape rate).

    ``step`` needs generation_s, update_s, decode_steps (longest completion), rows, context (mean
    context length while decoding), lengths (tokens per row) and loss_tokens.
    """
    rates = gemm_rates(m, precision)
    ceiling = rates["square_2048"]
    train_rate = next(v for k, v in rates.items() if k.startswith("train_"))
    dec = decode_bound_s(shape, int(step["rows"]), step["context"], read_gbs(m), ceiling, DTYPE_BYTES[precision])
    achieved_step = step["generation_s"] / max(step["decode_steps"], 1)
    matmuls = decode_matmuls_of(m, precision)
    fl = update_flops(shape, step["lengths"], int(step["loss_tokens"]), lora_r=lora_r, checkpointing=checkpointing, head_recompute=head_recompute)
    update_bound = fl["total"] / (ceiling * 1e9)
    update_blas = fl["total"] / (train_rate * 1e9)
    return {
        "precision": precision,
        "decode_step_ms": achieved_step * 1e3,
        "decode_bound_ms": dec["bound_s"] * 1e3,
        "decode_memory_bound_ms": dec["memory_s"] * 1e3,
        "decode_compute_bound_ms": dec["compute_s"] * 1e3,
        "decode_matmuls_ms": matmuls * 1e3,
        "generation_fraction_of_bound": dec["bound_s"] / achieved_step,
        "generation_fraction_of_blas": matmuls / achieved_step,
        "blas_decode_fraction_of_bound": dec["bound_s"] / matmuls,
        "update_flops": fl,
        "update_bound_s": update_bound,
        "update_blas_s": update_blas,
        "update_gflops": fl["total"] / step["update_s"] / 1e9,
        "update_fraction_of_ceiling": update_bound / step["update_s"],
        "update_fraction_of_blas": update_blas / step["update_s"],
        "ceiling_gflops": ceiling,
        "train_shape_gflops": train_rate,
        "read_gbs": read_gbs(m),
    }


def update_variants(shape: Shape, lengths: list[int], loss_tokens: int, lora_r: int, top_layers: int = 4) -> dict[str, float]:
    """GFLOP of one update under the alternatives step.py compares (LoRA everywhere or on the top
    layers; with and without gradient checkpointing; full fine-tuning for scale)."""
    out = {}
    for name, kw in (("lora_all_ckpt", dict(lora_r=lora_r, checkpointing=True)),
                     ("lora_all_no_ckpt", dict(lora_r=lora_r, checkpointing=False)),
                     (f"lora_top{top_layers}_ckpt", dict(lora_r=lora_r, lora_layers=top_layers, checkpointing=True)),
                     (f"lora_top{top_layers}_no_ckpt", dict(lora_r=lora_r, lora_layers=top_layers, checkpointing=False)),
                     ("full_ft_no_ckpt", dict(lora_r=None, checkpointing=False))):
        out[name] = update_flops(shape, lengths, loss_tokens, **kw)["total"] / 1e9
    return out


def model_shape(model_dir: Optional[str] = None) -> Shape:
    """The benchmark model's shape, from its config (the de-quantised demo model by default)."""
    from transformers import AutoConfig

    if model_dir is None:
        from lldslight.policy import PolicyConfig, resolve_model_dir

        model_dir = resolve_model_dir(PolicyConfig())
    return Shape.from_config(AutoConfig.from_pretrained(model_dir))


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    p.add_argument("--rows", type=int, default=8, help="decode rows (the step benchmark's prompts x G)")
    p.add_argument("--mb", type=int, default=256, help="MiB per bandwidth array")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--model", default=None, help="HF directory whose config gives the shape (default: the demo model)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    shape = model_shape(args.model)
    out = {}
    for t in [int(x) for x in args.threads.split(",")]:
        m = measure(t, shape, args.rows, mb=args.mb, repeats=args.repeats)
        out[str(t)] = m
        mem = shape.decode_bytes() / (read_gbs(m) * 1e9)
        comp = shape.decode_flops(args.rows, 64) / (m["sgemm_gflops"]["square_2048"] * 1e9)
        print(f"[bounds] {t} thread(s): read {m['torch_read_gbs']:.1f} (torch) / {m['numpy_read_gbs']:.1f} (numpy) GB/s, "
              f"copy {m['torch_copy_gbs']:.1f} / {m['numpy_copy_gbs']:.1f} GB/s; sgemm " +
              ", ".join(f"{k} {v:.0f}" for k, v in m["sgemm_gflops"].items()) + " GFLOP/s")
        print(f"         decode step ({args.rows} rows): >= {mem * 1e3:.1f} ms reading {shape.decode_bytes() / 1e6:.0f} MB, "
              f">= {comp * 1e3:.1f} ms of FLOPs; its matmuls alone take {m['decode_matmuls_s'] * 1e3:.1f} ms "
              f"({m['decode_matmuls_gbs']:.1f} GB/s); other processes {m['load']['other_cores']:.2f} cores")
        mem16 = shape.decode_bytes(2) / (read_gbs(m) * 1e9)
        comp16 = shape.decode_flops(args.rows, 64) / (m["bf16_gemm_gflops"]["square_2048"] * 1e9)
        print(f"         bf16 ({'native' if m['cpu_bf16']['native'] else 'NOT native'}: {m['cpu_bf16']['evidence']}): " +
              ", ".join(f"{k} {v:.0f}" for k, v in m["bf16_gemm_gflops"].items()) + " GFLOP/s; decode step >= "
              f"{mem16 * 1e3:.1f} ms reading {shape.decode_bytes(2) / 1e6:.0f} MB, >= {comp16 * 1e3:.1f} ms of FLOPs; "
              f"its matmuls alone take {m['decode_matmuls_bf16_s'] * 1e3:.1f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
