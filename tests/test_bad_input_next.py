"""The next round of bad input (docs/errors_and_resume.md): each case ends in one line naming the
file, key or value (exit 2), before the policy loads where the input allows, or does what the docs
promise; nothing the user made is lost or overwritten.

"Before the policy loads" uses tests/test_bad_input.py's model directory (SmolLM2's real config.json,
30 decoder layers, and a garbage weights file): a test that sees its own message proves its check
ran first.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_bad_input import assert_one_line_error, run_cli, tiny_config, unloadable_model, work  # noqa: F401


def fit_args(cfg: Path, runs: Path, *extra: str) -> list[str]:
    return ["fit", "--config", str(cfg), "--trainer.logger.init_args.save_dir", str(runs), *extra]


# --------------------------------------------------------------------------- the layers a config names


@pytest.mark.parametrize("layers, needles", [
    # peft read [] as "no restriction": every layer trained
    ("[]", ["model.policy.lora.layers_to_transform must be a non-empty list", "got []"]),
    ("[-1]", ["model.policy.lora.layers_to_transform must be decoder layer indices, integers >= 0", "got [-1]"]),
    ("[3, 3]", ["model.policy.lora.layers_to_transform must be a list of distinct layer indices"]),
    # SmolLM2-135M has 30 decoder layers: 30 is one past the last (peft's IndexError)
    ("[29, 30]", ["model.policy.lora.layers_to_transform must be layer indices in 0..29 (the model's 30 decoder layers)",
                  "got [29, 30]"]),
])
def test_lora_layers_are_checked_before_the_model_loads(work, unloadable_model, capsys, layers, needles):
    cfg = tiny_config(work / "layers.yaml", model=unloadable_model)
    code, err = run_cli(fit_args(cfg, work / "runs_layers", "--model.policy.lora.layers_to_transform", layers), work, capsys)
    assert_one_line_error(code, err, "fit", *needles)


def test_frozen_layers_past_the_model_are_named_with_their_full_key_before_loading(work, unloadable_model, capsys):
    cfg = tiny_config(work / "freeze.yaml", model=unloadable_model)
    code, err = run_cli(fit_args(cfg, work / "runs_freeze", "--model.policy.lora", "null",
                                 "--model.policy.freeze_bottom_layers", "30"), work, capsys)
    assert_one_line_error(code, err, "fit", "model.policy.freeze_bottom_layers must be < the model's 30 decoder layers, got 30")
    code, err = run_cli(fit_args(cfg, work / "runs_freeze", "--model.policy.freeze_bottom_layers", "2"), work, capsys)
    assert_one_line_error(code, err, "fit", "model.policy.freeze_bottom_layers must be 0 with model.policy.lora set, got 2")
