"""LLDS (docs/llds.md): the penalty worked out by hand per gate / normaliser / answer weight, its
gradient, the callback (answer-masking beta, on-policy skip, single-update warning), the YAML
composition with the base configs, and a tiny real fit where the term turns on."""
from __future__ import annotations

import csv
import math
import sys
from pathlib import Path

import pytest
import torch
import yaml

from lldslight.update import objectives as obj
from lldslight.callbacks import LLDS, GradientSpikeGuard, SearchRollout
from lldslight.module import GRPOModule
from lldslight.trajectory import Trajectory
from lldslight.update import LossContext
from lldslight.update.train import Totals, mean_valid_searches
from lldslight.update import UpdateConfig

REPO = Path(__file__).resolve().parents[1]

# Four rollouts, T = 12. Positions 0-1 are the prompt; "o" marks observation tokens; "." padding.
#   row 0  A=+1   a0: t2 t3 t4 (d .5 -.2 .1, sum .4)  o o  a1: t7 t8 t9 (d -.5 .3 .1, sum -.1)  answer t8 t9
#   row 1  A= 0   a0: t2 t3 t4 (d .2 .2 -.1, sum .3)  o o  a1: t7 t8    (d -.1 .4,   sum .3)   answer t8
#   row 2  A=-1   a0: t2..t6   (d 1 each)             -- not preserving: never counts
#   row 3  A=+.5  a0: t2 t3    (d .3 -.6, sum -.3)    o    a1: t5 t6    (d .1 -.2,   sum -.1)  answer t6
# Observation and padding positions carry a large d (9): masking must hide them.
D = torch.tensor(
    [
        [0, 0, 0.5, -0.2, 0.1, 9, 9, -0.5, 0.3, 0.1, 9, 9],
        [0, 0, 0.2, 0.2, -0.1, 9, 9, -0.1, 0.4, 9, 9, 9],
        [0, 0, 1, 1, 1, 1, 1, 9, 9, 9, 9, 9],
        [0, 0, 0.3, -0.6, 9, 0.1, -0.2, 9, 9, 9, 9, 9],
    ],
    dtype=torch.float64,
)
ACTION = torch.tensor(
    [
        [-1, -1, 0, 0, 0, -1, -1, 1, 1, 1, -1, -1],
        [-1, -1, 0, 0, 0, -1, -1, 1, 1, -1, -1, -1],
        [-1, -1, 0, 0, 0, 0, 0, -1, -1, -1, -1, -1],
        [-1, -1, 0, 0, -1, 1, 1, -1, -1, -1, -1, -1],
    ]
)
MASK = ACTION >= 0
ANSWER = torch.zeros_like(MASK)
ANSWER[0, 8] = ANSWER[0, 9] = ANSWER[1, 8] = ANSWER[2, 6] = ANSWER[3, 6] = True
ADV = torch.tensor([1.0, 0.0, -1.0, 0.5], dtype=torch.float64)
N_PRESERVING, N_ALL = 15, 20  # model tokens of rows 0, 1, 3 (6 + 5 + 4) and of all rows (+5)

# (gate) -> (sum of contributions, active tokens, active actions), by hand from the table above.
HAND = {
    # a0 of rows 0 and 1 and a1 of row 1 are open: .5+.1 + .2+.2 + .4
    "action": (1.4, 5, 3),
    # rows 0 (sum .3) and 1 (sum .6) are open, row 3 (-.4) closed: .5+.1+.3+.1 + .2+.2+.4
    "response": (1.8, 7, 4),
    # every positive d of rows 0, 1, 3: 1.0 + .8 + .3+.1
    "token": (2.2, 9, 6),
}


def _penalty(gate, normaliser=N_PRESERVING, weight=None, d=D):
    logp = torch.full(d.shape, -1.0, dtype=torch.float64, requires_grad=True)
    old_logp = logp.detach() + d
    loss, diag = obj.llds_penalty(logp, old_logp, ADV, MASK, ACTION, normaliser, gate, weight)
    return loss, diag, logp


@pytest.mark.parametrize("gate", ["action", "response", "token"])
@pytest.mark.parametrize("normaliser", ["preserving", "all"])
def test_penalty_by_hand(gate, normaliser):
    total, tokens, actions = HAND[gate]
    n = N_PRESERVING if normaliser == "preserving" else N_ALL
    loss, diag, _ = _penalty(gate, n)
    assert loss.item() == pytest.approx(total / n, abs=1e-12)
    assert diag["active_tokens"].item() == tokens
    assert diag["active_actions"].item() == actions
    assert diag["preserving_tokens"].item() == N_PRESERVING


def test_answer_weight_by_hand():
    # beta = .5 on answer tokens: of them only row 1's t8 (d .4) is active under the action gate.
    weight = torch.where(ANSWER, 0.5, 1.0).to(torch.float64)
    loss, diag, _ = _penalty("action", weight=weight)
    assert loss.item() == pytest.approx((0.6 + 0.4 + 0.5 * 0.4) / N_PRESERVING, abs=1e-12)
    assert diag["active_tokens"].item() == 5
    # beta = 0 removes the answer token entirely (and row 1's a1 no longer has an active token);
    # the gate still sums the unweighted d, so the other tokens are unaffected.
    weight0 = torch.where(ANSWER, 0.0, 1.0).to(torch.float64)
    loss0, diag0, _ = _penalty("action", weight=weight0)
    assert loss0.item() == pytest.approx(1.0 / N_PRESERVING, abs=1e-12)
    assert (diag0["active_tokens"].item(), diag0["active_actions"].item()) == (4, 2)


@pytest.mark.parametrize("gate", ["action", "response", "token"])
def test_zero_when_policy_equals_old(gate):
    logp = torch.randn(4, 12, dtype=torch.float64).neg().abs().neg().requires_grad_()
    loss, diag = obj.llds_penalty(logp, logp.detach().clone(), ADV, MASK, ACTION, N_PRESERVING, gate)
    loss.backward()
    assert loss.item() == 0.0
    assert diag["active_tokens"].item() == 0
    assert torch.count_nonzero(logp.grad) == 0


@pytest.mark.parametrize("gate", ["action", "response", "token"])
def test_gradient_is_minus_lambda_over_n_on_active_tokens(gate):
    lam = 0.2
    loss, _, logp = _penalty(gate)
    (lam * loss).backward()
    # Active tokens, by hand: positive d in open units of preserving rows.
    active = torch.zeros_like(MASK)
    open_units = {
        "action": [(0, [2, 3, 4]), (1, [2, 3, 4]), (1, [7, 8])],
        "response": [(0, [2, 3, 4, 7, 8, 9]), (1, [2, 3, 4, 7, 8])],
        "token": [(0, [2, 3, 4, 7, 8, 9]), (1, [2, 3, 4, 7, 8]), (3, [2, 3, 5, 6])],
    }[gate]
    for row, cols in open_units:
        for c in cols:
            active[row, c] = D[row, c] > 0
    expected = -lam / N_PRESERVING * active.to(torch.float64)
    assert torch.allclose(logp.grad, expected, atol=1e-15, rtol=0)
    assert torch.count_nonzero(logp.grad[~MASK]) == 0  # observations and padding get nothing


def test_gradient_through_a_model_is_the_nll_of_active_tokens():
    """Through real parameters: grad(lambda L) = -lambda/N * sum over active tokens of grad log p."""
    torch.manual_seed(0)
    lam = 0.2
    head = torch.nn.Linear(8, 7, dtype=torch.float64)
    x = torch.randn(4, 12, 8, dtype=torch.float64)
    y = torch.randint(0, 7, (4, 12))

    def token_logp():
        return torch.log_softmax(head(x), -1).gather(-1, y.unsqueeze(-1)).squeeze(-1)

    old = token_logp().detach() + D  # d = old - logp = D at the current weights
    loss, diag = obj.llds_penalty(token_logp(), old, ADV, MASK, ACTION, N_PRESERVING, "action")
    (lam * loss).backward()
    got = [p.grad.clone() for p in head.parameters()]
    head.zero_grad()
    active = torch.zeros_like(MASK)
    active[0, 2] = active[0, 4] = active[1, 2] = active[1, 3] = active[1, 8] = True
    assert diag["active_tokens"].item() == int(active.sum())
    (-lam / N_PRESERVING * token_logp()[active].sum()).backward()
    for g, want in zip(got, (p.grad for p in head.parameters())):
        assert torch.allclose(g, want, atol=1e-14, rtol=0)


def test_bad_options_name_the_value():
    with pytest.raises(ValueError, match="'row'"):
        _penalty("row")
    with pytest.raises(ValueError, match="'every'"):
        LLDS(normaliser="every")
    with pytest.raises(ValueError, match="LLDS.gate"):
        LLDS(gate="sequence")
    with pytest.raises(ValueError, match="LLDS.answer_masking"):
        LLDS(answer_masking="adaptive")


# -- the callback ---------------------------------------------------------------------------------


def _rollout(num_searches: list[int]) -> Trajectory:
    B, T = len(num_searches), ACTION.shape[1]
    return Trajectory(
        input_ids=torch.zeros(B, T, dtype=torch.long),
        attention_mask=torch.ones(B, T, dtype=torch.long),
        prompt_len=torch.full((B,), 2),
        loss_mask=MASK[:B],
        action_id=ACTION[:B],
        answer_mask=ANSWER[:B],
        group_id=torch.arange(B),
        reward=torch.zeros(B),
        num_searches=torch.tensor(num_searches),
        num_invalid=torch.zeros(B, dtype=torch.long),
        num_actions=torch.full((B,), 2),
        finish_reason=["answer"] * B,
        data_source=["t"] * B,
        responses=[""] * B,
    )


def _ctx(rollout: Trajectory, update_index: int = 1, totals: Totals = Totals(N_ALL, 3, N_PRESERVING)) -> LossContext:
    logp = torch.full(D.shape, -1.0, dtype=torch.float64, requires_grad=True)
    return LossContext(
        logp=logp,
        old_logp=logp.detach() + D,
        ref_logp=None,
        advantage=ADV,
        loss_mask=MASK,
        action_id=ACTION,
        answer_mask=ANSWER,
        num_searches=rollout.num_searches,
        totals=totals,
        mean_valid_searches=mean_valid_searches(rollout),
        update_index=update_index,
    )


@pytest.mark.parametrize(
    "masking, answer_coef, beta",
    # V = (0+1+2+3)/4 = 1.5; official: min(answer_coef * 0.5, 0.2) / 0.2
    [("off", None, 1.0), ("fixed", None, 0.3), ("paper", None, 0.75), ("official", None, 0.5), ("official", 0.1, 0.25),
     ("official", 0.8, 1.0)],
)
def test_callback_answer_masking_beta(masking, answer_coef, beta):
    cb = LLDS(coef=0.2, answer_masking=masking, answer_beta=0.3, answer_coef=answer_coef)
    rollout = _rollout([0, 1, 2, 3])
    ctx = _ctx(rollout)
    term = cb.loss_term(ctx)
    weight = torch.ones(D.shape, dtype=torch.float64).masked_fill(ANSWER, beta)
    want, diag = obj.llds_penalty(ctx.logp, ctx.old_logp, ADV, MASK, ACTION, N_PRESERVING, "action", weight)
    assert term.item() == pytest.approx(0.2 * want.item(), abs=1e-12)
    assert cb.last_beta == pytest.approx(beta)
    assert ctx.metrics["llds/loss"] == pytest.approx(want.item())
    assert ctx.metrics["llds/active_tokens"] == diag["active_tokens"].item()
    assert ctx.metrics["llds/active_actions"] == diag["active_actions"].item()


def test_official_beta_by_hand():
    # answer tokens get min(lambda_ans * max(V-1, 0), lambda) instead of lambda (official code).
    assert obj.answer_weight_beta(3.0, "official", coef=0.2, answer_coef=0.1) == pytest.approx(1.0)
    assert obj.answer_weight_beta(2.0, "official", coef=0.2, answer_coef=0.1) == pytest.approx(0.5)
    assert obj.answer_weight_beta(0.5, "official", coef=0.2, answer_coef=0.1) == 0.0
    assert obj.answer_weight_beta(1.7, "official", coef=0.3) == pytest.approx(0.7)  # lambda_ans = lambda: clip(V-1, 0, 1)
    assert obj.answer_weight_beta(1.0, "paper") == 0.5


def test_normaliser_is_the_mini_batch_total_from_the_context():
    # These 4 rows as part of a larger mini-batch: the term divides by the mini-batch's totals.
    totals = Totals(tokens=2 * N_ALL, rows=6, preserving_tokens=2 * N_PRESERVING)
    for normaliser, n in (("preserving", totals.preserving_tokens), ("all", totals.tokens)):
        ctx = _ctx(_rollout([1, 1, 1, 1]), totals=totals)
        term = LLDS(coef=1.0, normaliser=normaliser).loss_term(ctx)
        assert term.item() == pytest.approx(HAND["action"][0] / n, abs=1e-12)


def test_callback_skips_the_on_policy_update():
    ctx = _ctx(_rollout([1, 1, 1, 1]), update_index=0)
    assert LLDS().loss_term(ctx).item() == 0.0 and "llds/loss" not in ctx.metrics
    ctx = _ctx(_rollout([1, 1, 1, 1]), update_index=0)
    assert LLDS(skip_on_policy=False).loss_term(ctx).item() > 0


def test_warns_when_every_rollout_batch_gets_one_update():
    cb = LLDS()
    with pytest.warns(UserWarning, match="updates_per_rollout"):
        cb.on_fit_start(None, GRPOModule(update=UpdateConfig(updates_per_rollout=1)))


def test_registers_once_and_refuses_a_second_llds():
    module = GRPOModule(update=UpdateConfig(updates_per_rollout=2))
    first = LLDS()
    first.setup(None, module, "fit")
    first.setup(None, module, "validate")  # the same callback again is fine
    assert module.loss_terms["llds"] == first.loss_term
    with pytest.raises(ValueError, match="two LLDS callbacks"):
        LLDS(gate="response").setup(None, module, "fit")


# -- YAML composition -------------------------------------------------------------------------------


def _instantiate(*configs: str):
    from lightning.pytorch.cli import LightningCLI

    from lldslight.cli.lightning import TRAINER_DEFAULTS
    from lldslight.data.datamodule import SearchQADataModule

    args = [a for c in configs for a in ("--config", str(REPO / "configs" / c))]  # an absolute c stays as it is
    return LightningCLI(
        GRPOModule, SearchQADataModule, args=args, run=False, trainer_defaults=TRAINER_DEFAULTS,
        save_config_callback=None, auto_configure_optimizers=False,
    )


@pytest.mark.parametrize(
    "extra, gate, masking",
    [("llds.yaml", "action", "off"), ("llds_response.yaml", "response", "off"), ("llds_ma.yaml", "action", "paper")],
)
def test_llds_configs_append_to_the_base_callbacks(monkeypatch, extra, gate, masking):
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "argv", ["lldslight"])
    cli = _instantiate("tiny.yaml", extra, "guard.yaml")
    kinds = [type(c) for c in cli.trainer.callbacks]
    assert SearchRollout in kinds and LLDS in kinds and GradientSpikeGuard in kinds
    llds = next(c for c in cli.trainer.callbacks if isinstance(c, LLDS))
    assert (llds.coef, llds.gate, llds.answer_masking) == (0.2, gate, masking)
    assert cli.model.update_config.updates_per_rollout >= 2


def test_yaml_bare_off_means_no_answer_masking(monkeypatch, tmp_path):
    # YAML 1.1 reads `off` as false; users write it anyway.
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "argv", ["lldslight"])
    extra = tmp_path / "off.yaml"
    extra.write_text("trainer:\n  callbacks+:\n    - class_path: lldslight.callbacks.LLDS\n      init_args: {answer_masking: off}\n")
    cli = _instantiate("tiny.yaml", str(extra))
    assert next(c for c in cli.trainer.callbacks if isinstance(c, LLDS)).answer_masking == "off"
    with pytest.raises(ValueError, match="ambiguous"):
        LLDS(answer_masking=True)


def test_grpo_config_has_no_llds(monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "argv", ["lldslight"])
    cli = _instantiate("tiny.yaml", "grpo.yaml")
    kinds = [type(c) for c in cli.trainer.callbacks]
    assert SearchRollout in kinds and LLDS not in kinds
    assert cli.model.update_config.updates_per_rollout == yaml.safe_load((REPO / "configs/llds.yaml").read_text())["model"]["update"]["updates_per_rollout"]


# -- a tiny real fit ------------------------------------------------------------------------------


class LengthReward:
    """A test reward with spread: a random-init policy never answers right, so exact match would
    give every group A = 0 and nothing would move. Any real change of the response changes it."""

    def __call__(self, response: str, golden_answers: list[str]) -> float:
        return (len(response) % 11) / 10.0


def test_tiny_fit_turns_llds_on_in_later_minibatches(tmp_path, monkeypatch):
    from lldslight.cli import main

    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "argv", ["lldslight"])
    base = yaml.safe_load((REPO / "configs/tiny.yaml").read_text())
    rollout_cb = next(c for c in base["trainer"]["callbacks"] if c["class_path"].endswith("SearchRollout"))
    rollout_cb["init_args"]["reward"] = {"class_path": f"{__name__}.LengthReward"}
    base_path = tmp_path / "tiny_spread_reward.yaml"
    base_path.write_text(yaml.safe_dump(base))
    main([
        "fit", "--config", str(base_path), "--config", str(REPO / "configs/llds.yaml"),
        "--trainer.logger.init_args.save_dir", str(tmp_path), "--trainer.max_steps", "1",
        "--model.optim.lr", "0.02", "--model.update.kl_coef", "0", "--model.update.shuffle_minibatches", "false",
    ])
    rows = list(csv.DictReader(next(tmp_path.rglob("metrics.csv")).open()))
    step = next(r for r in rows if r.get("llds/loss"))
    # llds/* average the updates where the term ran: the off-policy ones (1..3 of 4).
    assert float(step["llds/loss"]) > 0
    assert float(step["llds/active_tokens"]) > 0 and float(step["llds/active_actions"]) > 0
    assert float(step["llds/beta"]) == 1.0
    assert math.isfinite(float(step["train/pg_loss"])) and float(step["train/vetoed_updates"]) == 0
