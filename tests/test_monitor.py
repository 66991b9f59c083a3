"""LLDMonitor inside a real (tiny) fit: lld/* columns, a direct Delta measurement, resume state."""
from __future__ import annotations

import math

import pandas as pd
import pytest

from lld_run import monitored_run


@pytest.fixture(scope="module")
def run(tmp_path_factory, synth_kb, bm25) -> dict:
    return monitored_run(tmp_path_factory, synth_kb, bm25)


def test_monitor_logs_lld_columns_each_step(run) -> None:
    frame = pd.read_csv(run["run_dir"] / "metrics.csv").groupby("step").first()
    assert len(frame) == 2
    for column in ("lld/logp_pos", "lld/logp_neg", "lld/logp_zero", "lld/ref_logp_pos", "lld/ref_logp_neg",
                   "lld/logp_first_action", "lld/logp_later_actions", "lld/delta_correct", "lld/delta_incorrect", "lld/phase", "lld/warning"):
        assert column in frame.columns, column
    # The alternating reward splits groups, so both advantage sets hold real (negative) log-probs.
    assert (frame["lld/logp_pos"] < 0).all() and (frame["lld/logp_neg"] < 0).all()
    assert (frame["lld/n_pos"] > 0).all()
    # Delta is measured by a forward after lr=1e-2 updates: it is finite and not zero.
    assert frame["lld/delta_correct"].notna().all() and (frame["lld/delta_correct"].abs() > 1e-6).all()
    # Step 0 is exactly on-policy for the reference too (LoRA starts at zero): ref == pi_old.
    assert frame["lld/ref_logp_pos"].iloc[0] == pytest.approx(frame["lld/logp_pos"].iloc[0], abs=1e-4)
    assert frame["lld/phase"].astype(int).tolist() == [0, 0]  # window=3: still warming up
    assert run["trainer"].global_step == 2


def test_delta_matches_a_fresh_forward(run) -> None:
    """lld/delta_correct is (log pi_after - log pi_old) on the A>0 rows of the step's own rollout."""
    import torch

    from lldslight.science import diagnostics as diag

    module, monitor = run["module"], run["monitor"]
    traj = module.last_rollout
    rows = diag.correct_rows(traj.advantage, traj.reward).tolist()
    sub = traj.select(rows)
    with torch.no_grad():
        after = module.batch_logprobs(sub, reference=False)
    expected = diag.finish(diag.likelihood_delta(sub.old_logp, after, sub.loss_mask))
    assert monitor.last_metrics["lld/delta_correct"] == pytest.approx(expected, abs=1e-5)
    # lld/delta_incorrect: the same over the A < 0 rows, selected here by hand from the advantages.
    neg = [i for i, a in enumerate(traj.advantage.tolist()) if a < 0]
    assert neg, "no A < 0 row: the check would be vacuous"
    wrong = traj.select(neg)
    with torch.no_grad():
        after_wrong = module.batch_logprobs(wrong, reference=False)
    m = wrong.loss_mask.bool()
    by_hand = float((after_wrong - wrong.old_logp)[m].sum() / m.sum())
    assert monitor.last_metrics["lld/delta_incorrect"] == pytest.approx(by_hand, abs=1e-5)
    assert monitor.last_metrics["lld/delta_incorrect"] != pytest.approx(monitor.last_metrics["lld/delta_correct"], abs=1e-6)
    pos_tokens = traj.loss_mask & (traj.advantage > 0).unsqueeze(-1)
    assert monitor.last_metrics["lld/logp_pos"] == pytest.approx(diag.token_mean(traj.old_logp, pos_tokens))


def test_gate_open_rate_and_tool_calls_match_a_hand_count(run) -> None:
    """lld/gate_open_actions: of the actions of A >= 0 responses, the share whose summed log-prob fell
    during the step, counted here action by action in Python from a fresh forward."""
    import torch

    module, monitor = run["module"], run["monitor"]
    traj = module.last_rollout
    rows = (traj.advantage >= 0).nonzero()[:, 0].tolist()
    assert rows, "no A >= 0 row: the check would be vacuous"
    sub = traj.select(rows)
    with torch.no_grad():
        after = module.batch_logprobs(sub, reference=False)
    opened = actions = fell_rows = 0
    for b in range(len(sub)):
        per_action: dict[int, float] = {}
        for t in range(sub.input_ids.shape[1]):
            if sub.loss_mask[b, t]:
                a = int(sub.action_id[b, t])
                per_action[a] = per_action.get(a, 0.0) + float(sub.old_logp[b, t] - after[b, t])
        actions += len(per_action)
        opened += sum(v > 0 for v in per_action.values())
        fell_rows += sum(per_action.values()) > 0
    assert monitor.last_metrics["lld/gate_open_actions"] == pytest.approx(opened / actions, abs=1e-6)
    assert monitor.last_metrics["lld/gate_open_responses"] == pytest.approx(fell_rows / len(sub), abs=1e-6)
    searched = sum(int(n) > 0 for n in traj.num_searches)
    assert monitor.last_metrics["diag/tool_call_rate"] == pytest.approx(searched / len(traj))
    assert monitor.last_metrics["diag/searches_per_action"] == pytest.approx(float(traj.num_searches.sum() / traj.num_actions.sum()))
    frame = pd.read_csv(run["run_dir"] / "metrics.csv")
    for column in ("lld/gate_open_actions", "lld/gate_open_responses", "diag/tool_call_rate", "diag/p_eos"):
        assert column in frame.columns, column


def test_monitor_writes_plot_at_end_of_fit(run) -> None:
    png = run["run_dir"] / "lld.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_state_dict_round_trip(run) -> None:
    from lldslight.callbacks import LLDMonitor
    from lldslight.science.diagnostics import PhaseConfig

    state = run["monitor"].state_dict()
    assert state["detector"]["seen"] == 2
    fresh = LLDMonitor(phases=PhaseConfig(window=3, patience=1))
    fresh.load_state_dict(state)
    assert fresh.detector.state_dict() == run["monitor"].detector.state_dict()
    a = fresh.detector.update(-1.0, 1.0, 1.0)
    b = run["monitor"].detector.update(-1.0, 1.0, 1.0)
    assert (a.phase, a.slope, a.smoothed) == (b.phase, b.slope, b.smoothed)


def test_bad_arguments_are_named() -> None:
    from lldslight.callbacks import LLDMonitor

    with pytest.raises(ValueError, match="on_warning"):
        LLDMonitor(on_warning="panic")
    with pytest.raises(ValueError, match="correct_set"):
        LLDMonitor(correct_set="A>=0")


def test_the_monitor_counts_negative_tokens_in_prefixes_shared_with_a_correct_row():
    """lld/neg_shared_share on a hand-worked group: rows (prompt 1 2 | model tokens):
    row 0, A > 0: 1 2 | 5 6 7;  row 1, A < 0: 1 2 | 5 6 9 9;  row 2, A < 0: 1 2 | 8 6.
    Row 1 shares 5 6 with row 0 (2 of its 4 model tokens), row 2 none of its 2: 2 of 6."""
    import torch

    from lldslight.callbacks.monitor import neg_shared_share
    from lldslight.trajectory import Trajectory

    ids = torch.tensor([[1, 2, 5, 6, 7, 0], [1, 2, 5, 6, 9, 9], [1, 2, 8, 6, 0, 0]])
    attn = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    mask = attn.bool() & (torch.arange(6) >= 2)
    traj = Trajectory(
        input_ids=ids, attention_mask=attn, prompt_len=torch.tensor([2, 2, 2]), loss_mask=mask, action_id=torch.where(mask, 0, -1),
        answer_mask=torch.zeros_like(mask), group_id=torch.zeros(3, dtype=torch.long), reward=torch.tensor([1.0, 0.0, 0.0]),
        num_searches=torch.zeros(3, dtype=torch.long), num_invalid=torch.zeros(3, dtype=torch.long),
        num_actions=torch.ones(3, dtype=torch.long), finish_reason=["answer"] * 3, data_source=["t"] * 3, responses=[""] * 3,
        advantage=torch.tensor([1.0, -0.5, -0.5]),
    )
    assert neg_shared_share(traj) == (2.0, 6.0)
