"""One mini-batch, one loss, one gradient, however the mini-batch is cut (lldslight/update/train.py).

Everything runs in float64, so that the tolerance measures the batching, not fp32 rounding.

An independent implementation (full logits, per-row Python loops for the LLDS gate, hand-written
advantages) computes the loss and gradient of the whole mini-batch; the real module must give the
same (relative 1e-6) with micro-batches of 1, 2 or all rows, packed by tokens, with a group's shared
prompt encoded once (the default) or in every row, and on 2 processes
(DDP with token packing, so the ranks run different numbers of micro-batches; FSDP2), with KL,
an entropy bonus and LLDS (answer masking whose V spans both ranks) on. The 2-process runs also
count the gradient collectives: one reduction per mini-batch, in its last micro-batch's backward.
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from update_parity import LENGTHS, make_setup, run
from lldslight.update import UpdateConfig
from lldslight.update.optim import OptimConfig

ROOT = Path(__file__).resolve().parents[1]
KL_COEF, ENT_COEF, LLDS_COEF, EPS = 0.05, 0.01, 0.2, 0.2


@pytest.fixture(scope="module")
def setup_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("update") / "setup.pt"
    make_setup(path)
    return path


@pytest.fixture(scope="module")
def setup(setup_file) -> dict:
    return torch.load(setup_file, weights_only=False)


def reference(setup: dict, aggregation: str, normaliser: str) -> tuple[float, dict[str, torch.Tensor]]:
    """The mini-batch loss of all 8 rows written out directly, and its gradient."""
    from update_parity import policy_config

    from lldslight.policy import load_policy

    model, _ = load_policy(policy_config())
    model.double().load_state_dict(setup["state"])
    traj = setup["traj"]
    ids, attn = traj.input_ids, traj.attention_mask
    mask = traj.loss_mask.clone()
    mask[:, 0] = False

    def token_logp_entropy(m):
        logp_all = torch.log_softmax(m(input_ids=ids, attention_mask=attn).logits[:, :-1], -1)  # float64
        zero = logp_all.new_zeros(len(ids), 1)
        logp = torch.cat([zero, logp_all.gather(-1, ids[:, 1:, None])[..., 0]], 1)
        entropy = torch.cat([zero, -(logp_all.exp() * logp_all).sum(-1)], 1)
        return logp, entropy

    logp, entropy = token_logp_entropy(model)
    with torch.no_grad(), model.disable_adapter():
        ref, _ = token_logp_entropy(model)
    old = traj.sample_logp
    adv = torch.zeros(len(ids), dtype=torch.float64)
    for g in traj.group_id.unique():
        rows = (traj.group_id == g).nonzero()[:, 0].tolist()
        r = [float(traj.reward[i]) for i in rows]
        for i in rows:
            adv[i] = (float(traj.reward[i]) - statistics.mean(r)) / (statistics.stdev(r) + 1e-6)

    ratio = torch.exp(logp - old)
    a = adv[:, None]
    pg = -torch.minimum(ratio * a, ratio.clamp(1 - EPS, 1 + EPS) * a)
    kl = (torch.exp(ref - logp) - (ref - logp) - 1).clamp(-10, 10)

    def agg(x):
        if aggregation == "token-mean":
            return x[mask].sum() / mask.sum()
        means = [x[b][mask[b]].mean() for b in range(len(ids)) if mask[b].any()]
        return sum(means) / len(means)

    loss = agg(pg) + KL_COEF * agg(kl) - ENT_COEF * agg(entropy)
    # LLDS, action gate, official answer weight from V over all 8 rows.
    v = float(traj.num_searches.float().mean())
    beta = min(max(v - 1, 0.0), 1.0)
    d = old - logp
    penalty = torch.zeros((), dtype=torch.float64)
    for b in range(len(ids)):
        if adv[b] < 0:
            continue
        for act in traj.action_id[b][mask[b]].unique().tolist():
            cols = ((traj.action_id[b] == act) & mask[b]).nonzero()[:, 0].tolist()
            if float(sum(d[b, c] for c in cols)) > 0:
                for c in cols:
                    weight = beta if traj.answer_mask[b, c] else 1.0
                    penalty = penalty + weight * torch.relu(d[b, c])
    preserving = mask & (adv >= 0)[:, None]
    loss = loss + LLDS_COEF * penalty / (preserving.sum() if normaliser == "preserving" else mask.sum())
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    grads = torch.autograd.grad(loss, list(params.values()))
    return float(loss), {f"policy.{n}": g for n, g in zip(params, grads)}


def assert_same(loss: float, grads: dict, want_loss: float, want: dict, what: str) -> None:
    assert loss == pytest.approx(want_loss, rel=1e-6), (what, loss, want_loss)
    assert grads.keys() == want.keys(), what
    diff = torch.cat([(grads[k] - want[k]).flatten() for k in want]).norm()
    norm = torch.cat([want[k].flatten() for k in want]).norm()
    assert norm > 0 and float(diff / norm) < 1e-6, (what, float(diff / norm))


@pytest.mark.parametrize("aggregation, normaliser", [("seq-mean-token-mean", "preserving"), ("token-mean", "all")])
def test_loss_and_gradient_do_not_depend_on_micro_batching(setup, aggregation, normaliser):
    want_loss, want = reference(setup, aggregation, normaliser)
    variants = {
        "1 row": dict(micro_batch_size=1),
        "2 rows": dict(micro_batch_size=2),
        "all rows": dict(micro_batch_size=len(LENGTHS)),
        "packed by tokens": dict(micro_batch_tokens=2 * max(LENGTHS)),
        # activation checkpointing changes no number: every layer recomputed, or under a budget of 0
        # (the first micro-batch keeps its layer's activations to measure it, the others recompute)
        "checkpointed": dict(micro_batch_size=2, policy=dict(gradient_checkpointing=True)),
        "auto, no room": dict(micro_batch_size=2, policy=dict(gradient_checkpointing="auto", activation_budget_mb=0)),
        # a group's rows share their prompt: encoded once (the default, every variant above), or in full
        "no shared prefix": dict(micro_batch_size=2, shared_prefix=False),
    }
    for name, kw in variants.items():
        probe = run(setup, list(range(len(LENGTHS))), aggregation=aggregation, llds_normaliser=normaliser, **kw)
        rec = probe.record
        assert rec["micro_batches"] == {"1 row": 8, "2 rows": 4, "all rows": 1, "packed by tokens": 4}.get(name, 4), name
        assert_same(rec["loss"], rec["grads"], want_loss, want, name)


def run_two_ranks(setup_file: Path, strategy: str, *args: str) -> list[dict]:
    out = setup_file.parent
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "update_parity.py"), str(out), strategy, *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("strategy, args", [("ddp", ("--micro-batch-tokens", "40")), ("fsdp2", ("--micro-batch-size", "2"))])
def test_two_ranks_give_the_one_rank_gradient_with_one_reduction(setup_file, setup, strategy, args):
    ranks = run_two_ranks(setup_file, strategy, *args)
    want_loss, want = reference(setup, "seq-mean-token-mean", "preserving")
    # Each rank's loss is its part of the mini-batch's; the gradient is the whole mini-batch's on both.
    assert_same(sum(r["loss"] for r in ranks), ranks[0]["grads"], want_loss, want, f"{strategy} rank 0")
    assert_same(sum(r["loss"] for r in ranks), ranks[1]["grads"], want_loss, want, f"{strategy} rank 1")
    counts = [r["micro_batches"] for r in ranks]
    if strategy == "ddp":
        # Packed by tokens (a group's shared prompt counted once), the ranks' rows make 3 and 2
        # micro-batches: only the last one reduces.
        assert sorted(counts) == [2, 3], counts
    else:
        assert counts == [2, 2]  # one group per micro-batch: its prompt encoded once
    for r in ranks:
        assert r["events"], "no gradient collective was seen: the count would be vacuous"
        assert set(r["events"]) == {r["micro_batches"]}, (strategy, r["events"], r["micro_batches"])


def test_logged_lr_is_the_one_the_updates_used(tmp_path):
    """train/lr of step s is the rate AdamW stepped with in s's updates (warm-up 1/4, 2/4, 3/4 of
    lr), not the next step's (the scheduler steps after the updates)."""
    import csv

    import lightning.pytorch as pl

    from lldslight.module import GRPOModule
    from lldslight.policy import load_policy
    from test_guard import FeedRollouts, small_config

    used: list[float] = []
    module = GRPOModule(policy=small_config(), update=UpdateConfig(updates_per_rollout=2, kl_coef=0.0), optim=OptimConfig(lr=0.01, warmup_steps=4))
    module.policy, module.tokenizer = load_policy(small_config())
    module.add_step_gate("lr", lambda ctx: used.append(ctx.module.optimizers(use_pl_optimizer=False).param_groups[0]["lr"]) or True)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=3, logger=pl.loggers.CSVLogger(tmp_path, name="lr"), enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1, callbacks=[FeedRollouts()],
    )
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(list(range(8)), batch_size=1, collate_fn=lambda b: b))
    rows = [r for r in csv.DictReader(next(tmp_path.rglob("metrics.csv")).open()) if r.get("train/lr")]
    logged = [float(r["train/lr"]) for r in sorted(rows, key=lambda r: int(r["step"]))]
    assert used == pytest.approx([0.0025, 0.0025, 0.005, 0.005, 0.0075, 0.0075])  # two updates per step
    assert logged == pytest.approx([0.0025, 0.005, 0.0075])


def test_select_slices_per_row_extras(setup):
    traj = setup["traj"]
    traj = traj.select(list(range(len(traj))))  # a copy
    B, T = traj.input_ids.shape
    traj.extras = {"sampled_ids": [[b] * b for b in range(B)], "score": torch.arange(B) * 10, "per_token": torch.ones(B, T),
                   "meta": {"run": 1}}
    sub = traj.select([5, 2])
    assert sub.extras["sampled_ids"] == [[5] * 5, [2] * 2]
    assert sub.extras["score"].tolist() == [50, 20]
    width = int(traj.attention_mask[[5, 2]].sum(-1).max())
    assert sub.extras["per_token"].shape == (2, width) == sub.input_ids.shape
    assert sub.extras["meta"] == {"run": 1}  # not per row: kept as is
    assert traj.extras["score"].shape == (B,)  # the original is untouched
