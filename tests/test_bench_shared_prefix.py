"""benchmarks/shared_prefix.py: its batches have the layout they claim (counted by hand), the
packed token count it reports is the hand count, the break-even reads a sweep as documented, and a
smoke run on a 2-layer model reports equal log-probs on both sides."""
import torch
from conftest import load_benchmark

sp = load_benchmark("shared_prefix")


def test_batches_have_the_documented_layout_and_packed_count():
    from lldslight.update import shared_prefix

    P, groups, G, R = 5, 2, 4, 8
    for layout, responses in (("equal", [8] * 8), ("spread", [4, 5, 6, 8] * 2)):  # R/2 + (R - R/2) * k // 3, k = 0..3
        ids, attn, mask, group = sp.batch(P, groups, G, R, layout, 1000, torch.Generator().manual_seed(0))
        assert attn.sum(-1).tolist() == [P + r for r in responses]
        assert mask.sum(-1).tolist() == responses
        assert group.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
        assert torch.equal(ids[0, :P], ids[3, :P]) and not torch.equal(ids[0, :P], ids[4, :P])
        assert not torch.equal(ids[0, P:P + 4], ids[1, P:P + 4])  # each row its own response
        packed = shared_prefix.pack_groups(ids, attn, group)
        assert packed.input_ids.shape[1] == groups * P + sum(responses)  # each prompt once, every response, no padding


def test_break_even_is_the_start_of_the_faster_tail():
    def pt(P, fwd, train):
        return {"prompt_tokens": P, "ratios": {"forward": {"ratio_of_medians": fwd}, "train": {"ratio_of_medians": train}}}

    assert sp.break_even_at([pt(8, 1.1, 0.9), pt(16, 0.9, 0.95), pt(32, 0.8, 0.7)]) == 16
    assert sp.break_even_at([pt(8, 0.9, 0.9), pt(16, 1.01, 0.95), pt(32, 0.8, 0.7)]) == 32  # a slower point in between restarts it
    assert sp.break_even_at([pt(8, 0.9, 0.9), pt(16, 0.9, 1.2)]) is None
    assert sp.break_even_at([pt(8, 0.5, 0.5)]) == 8


def test_a_smoke_run_reports_both_sides_equal(tmp_path):
    out = tmp_path / "sp.json"
    report = sp.main(["--tiny", "--prompt-tokens", "3", "9", "--response-tokens", "6", "--rounds", "1", "--repeats", "1",
                      "--threads", "1", "--no-repeat", "--json", str(out)])
    assert out.exists() and [(p["layout"], p["prompt_tokens"]) for p in report["points"]] == [("equal", 3), ("equal", 9), ("spread", 3), ("spread", 9)]
    for p in report["points"]:
        assert p["max_abs_logp_difference"] < 1e-5
        assert p["tokens"]["plain"] == 8 * (p["prompt_tokens"] + 6)
        assert p["sides"]["plain/train"]["ms"]["n"] == 1
    assert set(report["break_even_prompt_tokens"]) == {"equal", "spread"}
