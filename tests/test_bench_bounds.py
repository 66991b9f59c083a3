"""benchmarks/bounds.py's arithmetic: parameter and byte counts, the decode-step bound and the
update's FLOPs, on hand-worked numbers and against torch's own FLOP counter on a real forward and
backward. (The measurements themselves are timings: checked to run, not for their values.)"""
import pytest
import torch
from conftest import load_benchmark, tiny_policy_config

SMOLLM2 = dict(hidden=576, intermediate=1536, layers=30, heads=9, kv_heads=3, vocab=49152, head_dim=64, tied=True)


@pytest.fixture(scope="module")
def bounds():
    return load_benchmark("bounds")


def test_smollm2_counts_by_hand(bounds):
    s = bounds.Shape(**SMOLLM2)
    # per layer: q 576*576 + k, v 576*192 each + o 576*576 + gate, up, down 576*1536 each
    assert s.layer_params() == 331_776 + 2 * 110_592 + 331_776 + 3 * 884_736 == 3_538_944
    # 30 layers + tied embedding 49152*576 + 61 RMSNorm weights of 576
    assert s.params() == 30 * 3_538_944 + 28_311_552 + 61 * 576 == 134_515_008
    # a decode step reads all of it (the vocabulary projection is the tied embedding), 4 bytes each
    assert s.decode_bytes() == 4 * 134_515_008 == 538_060_032


def test_shape_counts_match_a_real_model(bounds, tiny_policy):
    model, _ = tiny_policy
    base = model.get_base_model()
    n = sum(p.numel() for name, p in base.named_parameters() if "lora_" not in name)
    assert bounds.Shape.from_config(base.config).params() == n


def test_decode_bound_for_known_bytes_and_bandwidth(bounds):
    s = bounds.Shape(**SMOLLM2)
    b = bounds.decode_bound_s(s, rows=8, context=0, read_gbs=10.0, sgemm_gflops=100.0)
    assert b["memory_s"] == pytest.approx(538_060_032 / 10e9)  # 53.8 ms
    # 8 rows x 2 FLOPs x (30 layers' 3,538,944 weights + the 28,311,552 of the projection)
    assert b["compute_s"] == pytest.approx(8 * 2 * (30 * 3_538_944 + 28_311_552) / 100e9)  # 21.5 ms
    assert b["bound_s"] == b["memory_s"]
    slow_gemm = bounds.decode_bound_s(s, rows=8, context=0, read_gbs=10.0, sgemm_gflops=20.0)
    assert slow_gemm["bound_s"] == slow_gemm["compute_s"] == pytest.approx(0.10758, rel=1e-4)


def test_update_flops_by_hand(bounds):
    # hidden 4, MLP 8, 2 layers, 2 heads of 2, 1 kv head: Linears q 4x4, k 4x2, v 4x2, o 4x4,
    # gate 4x8, up 4x8, down 8x4 = 144 weights; sum of (in + out) = 64.
    s = bounds.Shape(hidden=4, intermediate=8, layers=2, heads=2, kv_heads=1, vocab=10)
    # One row of 3 tokens (6 causal query-key pairs), 2 loss tokens, LoRA r=1 everywhere:
    #   Linears 2*144*3 = 864 per layer; attention 4*4*6 = 96; LoRA 2*1*64*3 = 384; head 2*4*10*2 = 160
    #   forward   2*(864 + 96) + 2*384 + 160 = 2848
    #   backward  2*(864 + 2*96 + 2*384) + 160 = 3808   (frozen bases: input gradients only)
    #   recompute 2*(864 + 96 + 384) = 2688              (checkpointing, head not recomputed)
    f = bounds.update_flops(s, [3], 2, lora_r=1, checkpointing=True)
    assert f == {"forward": 2848.0, "backward": 3808.0, "recompute": 2688.0, "total": 9344.0}
    # LoRA on the top layer only: backward and recompute stop there.
    top = bounds.update_flops(s, [3], 2, lora_r=1, lora_layers=1, checkpointing=False)
    assert top == {"forward": 2 * 960 + 384 + 160.0, "backward": 1824 + 160.0, "recompute": 0.0, "total": 2464 + 1984.0}
    # Full fine-tuning: weight gradients double the Linears' and the head's backward.
    full = bounds.update_flops(s, [3], 2, lora_r=None, checkpointing=False)
    assert full["backward"] == 2 * (2 * 864 + 2 * 96) + 2 * 160


@pytest.mark.parametrize("checkpointing", [False, True])
def test_update_flops_match_torchs_flop_counter(bounds, checkpointing):
    """A real fwd+bwd through lldslight's chunked log-probs (the frozen head's input gradient is
    formed in the forward, one matmul as a backward would: no head recompute), counted by
    torch.utils.flop_counter (matmuls only: CPU attention is not counted there)."""
    from torch.utils.flop_counter import FlopCounterMode

    from lldslight.update.logprobs import token_logprobs
    from lldslight.policy import load_policy

    cfg = tiny_policy_config(lora=True)
    cfg.random_init = dict(cfg.random_init, vocab_size=512, num_hidden_layers=4)  # layers dominate
    cfg.gradient_checkpointing = checkpointing
    model, _ = load_policy(cfg)
    model.train()
    model.enable_input_require_grads()  # else the lowest layer's q/k/v skip their input gradients
    shape = bounds.Shape.from_config(model.get_base_model().config)
    B, T = 2, 12
    ids = torch.randint(0, 500, (B, T), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[:, 5:] = True
    with FlopCounterMode(display=False) as counter:
        logp, _ = token_logprobs(model, ids, torch.ones_like(ids), mask, chunk_size=4)
        logp.sum().backward()
    counted = sum(counter.get_flop_counts()["Global"].values())
    f = bounds.update_flops(shape, [T] * B, int(mask[:, 1:].sum()), lora_r=cfg.lora.r, checkpointing=checkpointing, head_recompute=False)
    attention = shape.layers * shape.attn_flops(B * T * (T + 1) / 2) * (1 + 2 + checkpointing)
    if checkpointing:
        # Non-reentrant checkpointing stops re-running a layer once backward's saved tensors are back,
        # so the layer's last LoRA matmul is not recomputed: 0.1% here.
        assert counted == pytest.approx(f["total"] - attention, rel=2e-3)
    else:
        assert counted == f["total"] - attention


def test_measurements_run_and_report_the_load(bounds):
    s = bounds.Shape(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=512)
    m = bounds.measure(1, s, rows=4, train_rows=16, mb=8, repeats=1)
    for key in ("torch_read_gbs", "torch_copy_gbs", "numpy_read_gbs", "numpy_copy_gbs", "decode_matmuls_gbs"):
        assert m[key] > 0, key
    assert set(m["sgemm_gflops"]) == {"square_2048", "decode_4x64x128", "head_4x64x512", "train_16x64x128"}
    assert set(m["bf16_gemm_gflops"]) == set(m["sgemm_gflops"]) and all(v > 0 for v in m["bf16_gemm_gflops"].values())
    assert m["decode_matmuls_bf16_s"] > 0 and m["decode_matmuls_bf16_gbs"] > 0
    assert isinstance(m["cpu_bf16"]["native"], bool) and m["cpu_bf16"]["evidence"]
    assert m["load"]["wall_s"] > 0 and "other_cores" in m["load"]


def _measured(fp32_peak, bf16_peak, fp32_train, bf16_train, fp32_chain_s, bf16_chain_s, read_gbs=10.0):
    """A measure() result with chosen numbers (only the keys step_fractions reads)."""
    return {"torch_read_gbs": read_gbs, "numpy_read_gbs": read_gbs / 2,
            "sgemm_gflops": {"square_2048": fp32_peak, "train_512x576x1536": fp32_train},
            "bf16_gemm_gflops": {"square_2048": bf16_peak, "train_512x576x1536": bf16_train},
            "decode_matmuls_s": fp32_chain_s, "decode_matmuls_bf16_s": bf16_chain_s}


def test_step_fractions_per_precision_by_hand(bounds):
    """A decode step of 8 rows, context 0, on SmolLM2-135M: fp32 reads 538,060,032 bytes, bf16 half;
    both do 8 x 2 x 134,479,872 = 2,151,677,952 FLOPs (test_decode_bound_for_known_bytes_and_bandwidth)."""
    s = bounds.Shape(**SMOLLM2)
    m = _measured(fp32_peak=100.0, bf16_peak=400.0, fp32_train=50.0, bf16_train=200.0, fp32_chain_s=0.080, bf16_chain_s=0.040)
    step = {"generation_s": 1.0, "decode_steps": 10, "rows": 8, "context": 0, "update_s": 2.0, "lengths": [20] * 8, "loss_tokens": 80}
    fp32 = bounds.step_fractions(m, s, step, lora_r=16, head_recompute=False, precision="fp32")
    bf16 = bounds.step_fractions(m, s, step, lora_r=16, head_recompute=False, precision="bf16")
    assert fp32["decode_step_ms"] == bf16["decode_step_ms"] == pytest.approx(100.0)
    # fp32: memory 53.8 ms > FLOPs 21.5 ms at 100 GFLOP/s; bf16: memory 26.9 ms > FLOPs 5.4 ms at 400
    assert fp32["decode_bound_ms"] == fp32["decode_memory_bound_ms"] == pytest.approx(53.806, rel=1e-4)
    assert bf16["decode_bound_ms"] == bf16["decode_memory_bound_ms"] == pytest.approx(26.903, rel=1e-4)
    assert bf16["decode_compute_bound_ms"] == pytest.approx(2_151_677_952 / 400e9 * 1e3, rel=1e-6)
    assert fp32["generation_fraction_of_bound"] == pytest.approx(0.53806, rel=1e-4)
    assert bf16["generation_fraction_of_bound"] == pytest.approx(0.26903, rel=1e-4)
    # against the matmuls alone at the actual shapes: 80 of 100 ms, 40 of 100 ms
    assert fp32["generation_fraction_of_blas"] == pytest.approx(0.8) and bf16["generation_fraction_of_blas"] == pytest.approx(0.4)
    assert bf16["blas_decode_fraction_of_bound"] == pytest.approx(26.903 / 40.0, rel=1e-4)
    # the update: the same FLOPs, at each precision's peak and training-shape rate
    total = bounds.update_flops(s, [20] * 8, 80, lora_r=16, checkpointing=True)["total"]
    assert fp32["update_bound_s"] == pytest.approx(total / 100e9) and bf16["update_bound_s"] == pytest.approx(total / 400e9)
    assert bf16["update_blas_s"] == pytest.approx(total / 200e9)
    assert bf16["update_fraction_of_ceiling"] == pytest.approx(total / 400e9 / 2.0)
    assert bf16["update_fraction_of_blas"] == pytest.approx(total / 200e9 / 2.0)
    assert fp32["precision"] == "fp32" and bf16["ceiling_gflops"] == 400.0


def test_decode_step_against_bounds_by_hand(bounds):
    """decode_ops.py --bounds: SmolLM2's bf16 step of 100 ms on a machine reading 10 GB/s (numpy 5)
    with a 1,000 GFLOP/s bf16 peak: the weights' 2 bytes each take 26.9 ms, the FLOPs at 8 rows and
    no context 2.15 ms, so the limit is 26.9 ms = 27% of the step; 40 ms of Linears and 12 ms of
    adapters leave 48 ms outside the matmuls."""
    decode_ops = load_benchmark("decode_ops")
    s = bounds.Shape(**SMOLLM2)
    m = _measured(fp32_peak=200.0, bf16_peak=1000.0, fp32_train=100.0, bf16_train=500.0, fp32_chain_s=0.05, bf16_chain_s=0.04)
    b = decode_ops.against_bounds(100.0, s, rows=8, context=0, m=m, compute="bf16", adapters_ms=12.0)
    assert b["memory_bound_ms"] == pytest.approx(2 * 134_515_008 / 10e9 * 1e3)  # 26.90 ms
    assert b["compute_bound_ms"] == pytest.approx(8 * 2 * (30 * 3_538_944 + 28_311_552) / 1000e9 * 1e3)  # 2.15 ms
    assert b["bound_ms"] == b["memory_bound_ms"] and b["fraction_of_bound"] == pytest.approx(0.26903, rel=1e-4)
    assert (b["linears_alone_ms"], b["outside_matmuls_ms"]) == (pytest.approx(40.0), pytest.approx(48.0))
    fp32 = decode_ops.against_bounds(100.0, s, rows=8, context=0, m=m, compute="fp32", adapters_ms=0.0)
    assert fp32["bound_ms"] == pytest.approx(4 * 134_515_008 / 10e9 * 1e3) and fp32["linears_alone_ms"] == pytest.approx(50.0)


def test_adapter_matmuls_run(bounds):
    decode_ops = load_benchmark("decode_ops")
    s = bounds.Shape(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=512)
    assert decode_ops.adapter_matmuls_s(s, rows=4, r=2, threads=1, precision="bf16", repeats=1) > 0


def test_committed_decode_bounds_recomputed_and_quoted():
    """benchmarks/results/decode_bounds_epyc_bf16.json (decode_ops.py --bounds, 8 and 32 rows, 1 and 2 threads):
    each physical limit recomputed here from the machine figures it recorded (SmolLM2's bytes and
    FLOPs written out by hand), and docs/lab/speed.md's table quoting them."""
    import json

    from conftest import ROOT

    runs = json.loads((ROOT / "benchmarks" / "results" / "decode_bounds_epyc_bf16.json").read_text())["runs"]
    page = (ROOT / "docs" / "lab" / "speed.md").read_text()
    weights = 30 * 3_538_944 + 28_311_552  # multiply-adds per row: the layers' Linears and the vocabulary projection
    for rows, threads in ((8, 1), (8, 2), (32, 1), (32, 2)):
        r = runs[f"rows{rows}_threads{threads}"]
        m, b = r["machine"], r["bounds"]
        assert r["quiet"]["quiet"] and r["config"]["rows"] == rows and r["config"]["threads"] == threads
        assert "avx512_bf16" in r["cpu"]["cpu_flags_simd"]
        step = r["sides"]["current"]["ms_per_step"]["median"]
        memory = 2 * 134_515_008 / (max(m["torch_read_gbs"], m["numpy_read_gbs"]) * 1e9) * 1e3
        flops = rows * (2 * weights + 30 * 4 * 9 * 64 * 200)  # + QK^T and AV over 200 positions, 9 heads of 64
        compute = flops / (m["bf16_gemm_gflops"]["square_2048"] * 1e9) * 1e3
        assert b["memory_bound_ms"] == pytest.approx(memory) and b["compute_bound_ms"] == pytest.approx(compute)
        limit = max(memory, compute)
        linears = m["decode_matmuls_bf16_s"] * 1e3
        outside = step - linears - b["adapter_matmuls_alone_ms"]
        row = (f"| {rows}, {threads} | {step:.1f} | {memory:.1f}, {compute:.1f} | **{limit / step:.0%}** | {linears:.1f} | "
               f"{b['adapter_matmuls_alone_ms']:.1f} | {outside:.1f} ({outside / step:.0%}) | {limit / (linears + b['adapter_matmuls_alone_ms']):.0%} |")
        assert row in page, row


def test_committed_lean_adapter_figures_recomputed_and_quoted():
    """benchmarks/results/decode_lean_epyc_bf16.json (decode_ops.py --sides peft-forward current --bounds, 8 and 32
    rows, 1 and 2 threads): each side's median and the ratio recomputed from the kept attempts'
    raw per-run figures (statistics.median here, not the harness's summary), the two sides' logits
    equal, every run quiet on an AVX512-BF16 CPU, and docs/lab/speed.md's table row quoting them."""
    import json
    import statistics

    from conftest import ROOT

    runs = json.loads((ROOT / "benchmarks" / "results" / "decode_lean_epyc_bf16.json").read_text())["runs"]
    page = (ROOT / "docs" / "lab" / "speed.md").read_text()
    for rows, threads in ((8, 1), (8, 2), (32, 1), (32, 2)):
        r = runs[f"rows{rows}_threads{threads}"]
        assert r["quiet"]["quiet"] and (r["config"]["rows"], r["config"]["threads"]) == (rows, threads)
        assert "avx512_bf16" in r["cpu"]["cpu_flags_simd"] and r["max_abs_logit_difference"] == {"peft-forward": 0.0}
        kept = [a for a in r["attempts"] if a["kept"]]
        ms = {side: [a["metrics"]["ms_per_step"] for a in kept if a["side"] == side] for side in ("peft-forward", "current")}
        assert len(ms["current"]) == len(ms["peft-forward"]) == r["config"]["rounds"]
        peft, lean = statistics.median(ms["peft-forward"]), statistics.median(ms["current"])
        per_round = [c / p for c, p in zip(ms["current"], ms["peft-forward"])]
        b = r["bounds"]
        assert b["decode_step_ms"] == pytest.approx(lean)
        row = (f"| {rows}, {threads} | {peft:.1f} | {lean:.1f} | **{lean / peft:.2f}** [{min(per_round):.2f}-{max(per_round):.2f}] | "
               f"{b['bound_ms']:.1f} | {b['bound_ms'] / lean:.0%} | {b['outside_matmuls_ms']:.1f} ({b['outside_matmuls_ms'] / lean:.0%}) |")
        assert row in page, row
