"""A reward is the user's code (docs/errors_and_resume.md, "The reward and EM read the same
answer"): one that returns something other than a finite number, or raises, stops the run in one
line naming the reward and the question (``--debug`` for the traceback), where it used to be a
run that vetoed every update and exited 0, or a 70-line traceback naming neither; a reward in the
documented keyword form, or without type hints, is accepted by ``class_path``; a signature that
cannot be called is said exactly, before the model loads.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from tests.test_bad_input import TINY, assert_one_line_error, run_cli, unloadable_model, work  # noqa: F401

HELPERS = "tests.run_helpers"


def reward_config(path: Path, reward: dict, model: Path | None = None) -> Path:
    """tiny.yaml with ``reward`` as its SearchRollout's reward (and ``model`` as the policy)."""
    cfg = yaml.safe_load(TINY.read_text())
    cfg["trainer"]["callbacks"][0]["init_args"]["reward"] = reward
    if model is not None:
        cfg["model"]["policy"].update(model=str(model), random_init=None)
    path.write_text(yaml.safe_dump(cfg))
    return path


def fit(cfg: Path, tmp_path: Path, *extra: str) -> list[str]:
    return ["fit", "--config", str(cfg), "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"),
            "--trainer.max_steps", "1", *extra]


# --------------------------------------------------------------------------- the value a reward returns


@pytest.mark.parametrize("value, shown", [
    ("nan", "nan"), ("inf", "inf"), ("-inf", "-inf"),
    # finite as a Python float, infinite as the float32 a trajectory stores it in (max 3.4028e38)
    ("1e308", "1e+308"),
    ("none", "None"), ("pair", "tensor([0., 1.])"),
], ids=["nan", "inf", "-inf", "1e308", "None", "2-element tensor"])
def test_a_reward_that_is_not_a_finite_number_names_the_reward_and_the_question(value, shown):
    from lldslight.errors import UserError
    from lldslight.rewards import RewardCaller
    from tests.run_helpers import ConstantReward

    call = RewardCaller(ConstantReward(value))
    with pytest.raises(UserError) as err:
        call("text", ["Paris"], question="What is the capital of Freedonia?", data_source="synthkb", turns=())
    message = str(err.value)
    assert "\n" not in message
    for needle in (f"reward {HELPERS}.ConstantReward", f"returned {shown}",
                   "question 'What is the capital of Freedonia?'", "finite number"):
        assert needle in message, (needle, message)


def test_a_finite_reward_of_any_number_type_is_a_float():
    """What a reward may return: a Python or numpy number, a bool, a one-element tensor; the
    largest finite float32 still passes."""
    from lldslight.rewards import RewardCaller

    for value, expected in ((1, 1.0), (np.float64(0.25), 0.25), (True, 1.0), (torch.tensor([0.5]), 0.5),
                            (torch.tensor(-2.0), -2.0), (float(np.finfo(np.float32).max), float(np.finfo(np.float32).max))):
        got = RewardCaller(lambda r, g, v=value: v)("t", ["g"], question="q", data_source="s", turns=())
        assert type(got) is float and got == expected, (value, got)


def test_a_reward_that_raises_names_the_reward_and_the_question():
    from lldslight.errors import UserError
    from lldslight.rewards import RewardCaller
    from tests.run_helpers import RaisingReward

    with pytest.raises(UserError) as err:
        RewardCaller(RaisingReward())("text", ["Paris"], question="Who founded " + "x" * 300, data_source="s", turns=())
    message = str(err.value)
    assert f"reward {HELPERS}.RaisingReward raised KeyError: 'golden_answers[1]'" in message, message
    assert "question 'Who founded xxx" in message and len(message) < 400, message  # the question cut short
    assert isinstance(err.value.__cause__, KeyError)  # --debug prints it


@pytest.mark.slow
@pytest.mark.parametrize("reward, needles", [
    ({"class_path": f"{HELPERS}.ConstantReward", "init_args": {"value": "nan"}}, ["returned nan", "finite number"]),
    ({"class_path": f"{HELPERS}.ConstantReward", "init_args": {"value": "1e308"}}, ["returned 1e+308", "float32"]),
    ({"class_path": f"{HELPERS}.RaisingReward"}, ["raised KeyError"]),
], ids=["nan", "1e308", "raises"])
def test_a_bad_reward_stops_the_fit_in_one_line(work, capsys, tmp_path, reward, needles):
    """The real fit, which exited 0 having vetoed every update (NaN) or printed a 70-line traceback."""
    cfg = reward_config(tmp_path / "t.yaml", reward)
    code, err = run_cli(fit(cfg, tmp_path), work, capsys)
    name = reward["class_path"]
    line = assert_one_line_error(code, err, "fit", f"reward {name}", "for question '", *needles)
    assert not list((tmp_path / "runs").rglob("epoch=*.ckpt")), line  # no step trained on it
    code, err = run_cli(fit(cfg, tmp_path, "--debug"), work, capsys)
    assert code == 2 and "Traceback" in err and err.strip().splitlines()[-1].startswith("lldslight fit: error: reward")


# --------------------------------------------------------------------------- the signature


@pytest.mark.parametrize("reward", ["KeywordReward", "UntypedReward"])
def test_a_reward_in_the_keyword_form_or_without_type_hints_is_accepted(work, capsys, tmp_path, reward):
    cfg = reward_config(tmp_path / "t.yaml", {"class_path": f"{HELPERS}.{reward}"})
    code, err = run_cli(fit(cfg, tmp_path, "--print_config"), work, capsys)
    assert code in (0, None), err[-3000:]
    assert "does not implement protocol" not in err


def test_a_reward_signature_lldslight_cannot_call_is_said_before_the_model_loads(work, unloadable_model, capsys, tmp_path):
    cfg = reward_config(tmp_path / "t.yaml", {"class_path": f"{HELPERS}.ResponseOnlyReward"}, model=unloadable_model)
    code, err = run_cli(fit(cfg, tmp_path), work, capsys)
    assert_one_line_error(code, err, "fit", f"reward {HELPERS}.ResponseOnlyReward: its parameters must be "
                          "(response, golden_answers)", "question, data_source, turns", "got ['response']")


@pytest.mark.slow
def test_a_keyword_form_reward_trains_with_its_context(work, capsys, tmp_path):
    from tests.run_helpers import KeywordReward

    KeywordReward.seen.clear()
    cfg = reward_config(tmp_path / "t.yaml", {"class_path": f"{HELPERS}.KeywordReward"})
    code, err = run_cli(fit(cfg, tmp_path), work, capsys)
    assert code == 0, err[-3000:]
    # one step: data.batch_size 2 x group_size 2 rollouts, each scored with its question
    assert len(KeywordReward.seen) == 4 and all(s["question"] and s["data_source"] and s["turns"] >= 1
                                                for s in KeywordReward.seen), KeywordReward.seen
