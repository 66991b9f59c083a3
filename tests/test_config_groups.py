"""``model.update.*`` and ``model.optim.*``: the groups GRPOModule takes whole, the flat keys they
replaced (a user's gets one line naming its new place, before the model loads; a checkpoint's folds
in silently), the shipped configs written with the groups, and the one learning-rate setter
(lldslight/update/optim.py, lldslight/run/deprecated_keys.py).

The new places a flat key is told to go are written out here by hand, not read from the table the
code uses. The collapse lab's registered recipe is checked against its values written out by hand,
and with the command line its registration used (``-- --model.lr 5e-4``), which now names
``model.optim.lr``.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import ROOT

CONFIGS = sorted(  # the shipped configs that set model settings
    p for pattern in ("configs/*.yaml", "lab/configs/*.yaml", "lab/configs/arms/*.yaml", "configs/recipes/*.yaml", "benchmarks/*.yaml")
    for p in ROOT.glob(pattern) if (yaml.safe_load(p.read_text()) or {}).get("model")
)
# The flat keys of the release before the groups and where each went, by hand (docs/configuration.md).
MOVED_BY_HAND = {
    "lr": "optim", "weight_decay": "optim", "betas": "optim", "warmup_steps": "optim", "warmup_ratio": "optim",
    "optimizer": "optim", "updates_per_rollout": "update", "micro_batch_size": "update", "micro_batch_tokens": "update",
    "reuse_onpolicy_logp": "update", "old_logp_source": "update", "clip_eps": "update", "clip_eps_high": "update",
    "ratio_clamp": "update", "aggregation": "update", "normalize_adv_std": "update", "kl_coef": "update",
    "kl_estimator": "update", "entropy_coef": "update", "grad_clip": "update", "shuffle_minibatches": "update",
    "minibatch_grouping": "update", "negative_advantages": "update",
}


def _instantiate(args: list[str]):
    """The real CLI, built but not run (as tests/test_recipes.py does)."""
    from lldslight.cli.lightning import TRAINER_DEFAULTS, _cli_class

    cli_cls, module_cls, datamodule_cls = _cli_class()
    return cli_cls(module_cls, datamodule_cls, args=args, run=False, trainer_defaults=TRAINER_DEFAULTS,
                   seed_everything_default=0, auto_configure_optimizers=False, save_config_callback=None)


def _moved_line(where: str, *keys: str) -> str:
    """The error's message: where the keys were written, then each with its new place."""
    news = ", ".join(f"model.{k} is now model.{MOVED_BY_HAND[k]}.{k}" for k in keys)
    return f"{where}: {news}: write {'it' if len(keys) == 1 else 'them'} there (the flat model keys moved into model.optim and model.update)"


def _fit_error(args: list[str], capsys) -> tuple[int, list[str]]:
    """``lldslight fit ARGS``'s exit status and its error lines (the prefix ``lldslight fit: error:``
    dropped; Lightning's INFO lines left out), in this process, from the repository's root."""
    from tests.test_bad_input import run_cli

    code, err = run_cli(["fit", *args], ROOT, capsys)
    return code, [line.removeprefix("lldslight fit: error: ") for line in err.splitlines() if line.startswith("lldslight fit: error: ")]


# -- the shipped configs ------------------------------------------------------------------------------------


def test_every_shipped_config_was_found():
    names = {str(p.relative_to(ROOT)) for p in CONFIGS}
    assert {"configs/tiny.yaml", "lab/configs/constant.yaml", "lab/configs/arms/half_lr.yaml",
            "configs/recipes/qwen2.5-7b-base-grpo.yaml", "lab/configs/collapse.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=[str(p.relative_to(ROOT)) for p in CONFIGS])
def test_a_shipped_config_uses_the_groups(path):
    model = yaml.safe_load(path.read_text())["model"]
    assert not set(model) & set(MOVED_BY_HAND), f"{path.name}: flat keys {sorted(set(model) & set(MOVED_BY_HAND))}"


def test_the_lab_recipe_keeps_its_values_and_its_registered_command_line_names_the_new_key(tmp_path, capsys, monkeypatch):
    """lab/configs/constant.yaml and its arms, through the real CLI: the values of the recipe as
    registered (written out by hand here); the registration's ``-- --model.lr 5e-4`` now stops
    with one line naming ``model.optim.lr``, which sets the rate."""
    from lldslight.update.optim import OptimConfig
    from lldslight.update import UpdateConfig

    monkeypatch.chdir(ROOT)
    recipe = UpdateConfig(updates_per_rollout=8, micro_batch_size=16, ratio_clamp=100.0, kl_coef=0.0, old_logp_source="rollout")
    rate = OptimConfig(lr=7.0e-4, warmup_steps=30)
    arms = {
        "grpo": (recipe, rate),
        "half_lr": (recipe, OptimConfig(lr=3.5e-4, warmup_steps=30)),
        "kl": (UpdateConfig(**{**vars(recipe), "kl_coef": 0.05, "kl_estimator": "k3"}), rate),
        "onpolicy": (UpdateConfig(**{**vars(recipe), "updates_per_rollout": 1}), rate),
        "pos_only": (UpdateConfig(**{**vars(recipe), "negative_advantages": "drop"}), rate),
        "unshared": (UpdateConfig(**{**vars(recipe), "negative_advantages": "unshared"}), rate),
    }
    common = ["--config", "lab/configs/constant.yaml", "--model.policy.model", "smollm2-135m-instruct",
              "--trainer.logger.init_args.save_dir", str(tmp_path)]
    for arm, (update, optim) in arms.items():
        cli = _instantiate([*common, "--config", f"lab/configs/arms/{arm}.yaml"])
        assert (cli.model.update_config, cli.model.optim_config) == (update, optim), arm

    code, err = _fit_error([*common, "--config", "lab/configs/arms/half_lr.yaml", "--model.lr", "5e-4"], capsys)
    assert (code, err) == (2, [_moved_line("the command line", "lr")])
    cli = _instantiate([*common, "--config", "lab/configs/arms/half_lr.yaml", "--model.optim.lr", "5e-4"])
    assert cli.model.optim_config == OptimConfig(lr=5e-4, warmup_steps=30)  # the command line wins
    assert cli.model.update_config == recipe


def test_flat_keys_in_a_config_file_are_one_line_naming_each_new_place(tmp_path, capsys, monkeypatch):
    """tiny.yaml with its group settings written flat, as the release before the groups read them;
    and a config an earlier lldslight saved (every flat key listed as null): one line, exit 2."""
    monkeypatch.chdir(ROOT)
    tiny = yaml.safe_load((ROOT / "configs/tiny.yaml").read_text())
    flat = {k: v for group in ("update", "optim") for k, v in tiny["model"].pop(group).items()}
    assert flat and set(flat) <= set(MOVED_BY_HAND)
    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump({**tiny, "model": {**tiny["model"], **flat}}, sort_keys=False))
    code, err = _fit_error(["--config", str(old)], capsys)
    assert (code, err) == (2, [_moved_line(str(old), *flat)])
    saved = tmp_path / "saved.yaml"
    saved.write_text(yaml.safe_dump({"model": {"lr": None, "clip_eps": None}}, sort_keys=False))
    code, err = _fit_error(["--config", "configs/tiny.yaml", "--config", str(saved)], capsys)
    assert (code, err) == (2, [_moved_line(str(saved), "lr", "clip_eps")])


def test_a_flat_key_on_the_command_line_or_in_resume_override_is_one_line(tmp_path, capsys, monkeypatch):
    from lldslight.cli.resume import _override_keys
    from lldslight.errors import ConfigError

    monkeypatch.chdir(ROOT)
    code, err = _fit_error(["--config", "configs/tiny.yaml", "--model.kl_coef=0.1"], capsys)
    assert (code, err) == (2, [_moved_line("the command line", "kl_coef")])
    with pytest.raises(ConfigError) as refused:
        _override_keys("model.optim.lr,model.grad_clip", {"optim.lr", "update.grad_clip"})
    assert str(refused.value) == _moved_line("--resume_override", "grad_clip")
    assert _override_keys("model.optim.lr,model.update.grad_clip", {"optim.lr", "update.grad_clip"}) == {"optim.lr", "update.grad_clip"}


# -- class paths of modules that moved into folders -------------------------------------------------------------------

# Where each class users name by class path lives now, by hand (docs/scaling_and_resume.md, a config's trainer.plugins).
MOVED_LINE = "{old} is now {new}: write that (lldslight's modules moved into folders)"


def test_a_class_path_of_a_moved_module_is_one_line_naming_the_new_place(tmp_path, capsys, monkeypatch):
    """A config an earlier lldslight saved names its checkpoint writer at the old path, a command
    line the FSDP2 strategy at its old one: one line each naming the new place, exit 2, before the
    parse (jsonargparse's own error is every alternative of the Union)."""
    monkeypatch.chdir(ROOT)
    saved = tmp_path / "config.yaml"
    saved.write_text(yaml.safe_dump({"trainer": {"plugins": [{"class_path": "lldslight.checkpoint_io.AtomicCheckpointIO"}]}}))
    code, err = _fit_error(["--config", "configs/tiny.yaml", "--config", str(saved)], capsys)
    assert (code, err) == (2, [f"{saved}: trainer.plugins.class_path: " + MOVED_LINE.format(
        old="lldslight.checkpoint_io.AtomicCheckpointIO", new="lldslight.run.checkpoint_io.AtomicCheckpointIO")])
    code, err = _fit_error(["--config", "configs/tiny.yaml", "--trainer.strategy", "lldslight.distributed.FSDP2Strategy"], capsys)
    assert (code, err) == (2, ["the command line: " + MOVED_LINE.format(
        old="lldslight.distributed.FSDP2Strategy", new="lldslight.policy.distributed.FSDP2Strategy")])
    code, err = _fit_error(["--config", "configs/tiny.yaml", "--config", "{trainer: {strategy: {class_path: lldslight.distributed.FSDP2Strategy}}}"], capsys)
    assert code == 2 and len(err) == 1 and err[0].endswith("trainer.strategy.class_path: " + MOVED_LINE.format(
        old="lldslight.distributed.FSDP2Strategy", new="lldslight.policy.distributed.FSDP2Strategy"))


def test_the_moved_modules_table_names_modules_that_exist_where_the_old_ones_do_not():
    import importlib
    import importlib.util

    from lldslight.policy.distributed import FSDP2Strategy
    from lldslight.run.checkpoint_io import AtomicCheckpointIO
    from lldslight.run.deprecated_keys import MOVED_MODULES

    assert (FSDP2Strategy.__module__, AtomicCheckpointIO.__module__) == ("lldslight.policy.distributed", "lldslight.run.checkpoint_io")
    assert len(MOVED_MODULES) == 21
    for old, new in MOVED_MODULES.items():
        assert importlib.util.find_spec(old) is None, old
        assert importlib.import_module(new).__name__ == new


# -- checkpoints an earlier lldslight wrote ---------------------------------------------------------------------------


OLD_HPARAMS = {  # every hyper-parameter the flat GRPOModule saved (its signature's names), as LightningCLI wrote them
    "policy": None,  # filled in from tiny.yaml
    "lr": 2e-3, "weight_decay": 0.02, "betas": [0.8, 0.99], "warmup_steps": 3, "warmup_ratio": 0.0, "grad_clip": 0.5,
    "optimizer": "adamw", "updates_per_rollout": 2, "micro_batch_size": 2, "micro_batch_tokens": None,
    "reuse_onpolicy_logp": True, "old_logp_source": "recompute", "clip_eps": 0.3, "clip_eps_high": None, "ratio_clamp": None,
    "aggregation": "token-mean", "normalize_adv_std": True, "kl_coef": 0.01, "kl_estimator": "k1", "entropy_coef": 0.0,
    "logprob_temperature": 1.0, "logprob_chunk_size": None, "shuffle_minibatches": True, "minibatch_grouping": "rows",
    "negative_advantages": "keep", "fsdp": {"param_dtype": None, "reduce_dtype": None, "reshard_after_forward": True},
}


def test_an_old_checkpoints_flat_hyper_parameters_map_to_the_groups():
    from lldslight.run.deprecated_keys import nested
    from lldslight.update.optim import OptimConfig
    from lldslight.update import UpdateConfig

    groups = nested(OLD_HPARAMS)
    assert UpdateConfig(**groups["update"]) == UpdateConfig(
        grad_clip=0.5, updates_per_rollout=2, micro_batch_size=2, clip_eps=0.3, aggregation="token-mean", kl_coef=0.01, kl_estimator="k1")
    assert OptimConfig(**groups["optim"]) == OptimConfig(lr=2e-3, weight_decay=0.02, betas=(0.8, 0.99), warmup_steps=3)
    assert set(groups) == {"policy", "logprob_temperature", "logprob_chunk_size", "fsdp", "update", "optim"}
    # the form saved between the groups and this release: the groups, and every flat key null beside them
    between = {"update": {"clip_eps": 0.1}, "optim": {"lr": 5e-4}, **dict.fromkeys(MOVED_BY_HAND), "logprob_temperature": 1.0}
    assert nested(between) == {"update": {"clip_eps": 0.1}, "optim": {"lr": 5e-4}, "logprob_temperature": 1.0}


@pytest.mark.slow
def test_checkpoints_an_earlier_lldslight_wrote_resume(tmp_path):
    """A real checkpoint rewritten to the two forms earlier releases saved (every setting flat, no
    groups; the groups with every flat key null beside them) resumes: the settings land in the
    groups silently (the user did not write them), the resume line names what differs by its new
    key, and the scheduler goes on at the checkpoint's rate."""
    from test_resume import metrics, resume_fit, resume_lines

    run = tmp_path / "run"
    first = resume_fit(tmp_path, "first", run, 1)
    assert first.returncode == 0, first.stderr[-3000:]
    ckpt = run / "tiny" / "version_0" / "checkpoints" / "last.ckpt"
    saved = torch.load(ckpt, weights_only=True)
    hparams = saved["hyper_parameters"]
    assert hparams["optim"]["lr"] == 1e-3 and not set(hparams) & set(MOVED_BY_HAND)  # the groups' form only
    # The release before the groups saved its flat keys only: fields added to a group since have none.
    flat = {k: v for k, v in {**hparams["update"], **hparams["optim"]}.items() if k in MOVED_BY_HAND}
    forms = {"flat": {**{k: v for k, v in hparams.items() if k not in ("update", "optim")}, **flat},
             "groups and null flat keys": {**hparams, **dict.fromkeys(MOVED_BY_HAND)}}
    for version, (form, old) in enumerate(forms.items(), start=1):
        torch.save({**saved, "hyper_parameters": old}, ckpt)
        resumed = resume_fit(tmp_path, f"resumed{version}", run, 2, "--ckpt_path", "last", "--model.update.clip_eps", "0.1")
        assert resumed.returncode == 0, (form, resumed.stderr[-3000:])
        assert not [line for line in resumed.stderr.splitlines() if " is now model." in line], form
        assert resume_lines(resumed) == [
            f"[lldslight] resuming from {ckpt}: 1 setting(s) taken from the checkpoint, not your config: "
            "model.update.clip_eps=0.2 (yours: 0.1); --resume_override model.update.clip_eps (or all) uses yours"], form
        # warm-up 4 steps: step 1 (0-based) runs at 2/4 of the rate
        assert metrics(run / "tiny" / f"version_{version}" / "metrics.csv")[1]["train/lr"] == pytest.approx(1e-3 * 2 / 4, rel=1e-6), form
    # GRPOModule.load_from_checkpoint of the last form (every checkpoint before this release):
    # Lightning passes the module only the arguments its signature has, so the null flat keys drop out.
    from lldslight.module import GRPOModule

    module = GRPOModule.load_from_checkpoint(ckpt)
    assert module.optim_config.lr == 1e-3 and module.update_config.clip_eps == 0.2


# -- the learning-rate setter ----------------------------------------------------------------------------------------


def _warmed(lr: float, steps: int, warmup: int = 4):
    from lldslight.update.optim import OptimConfig, build_optimizer

    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    groups = [{"params": [params[0]]}, {"params": [params[1]]}]  # two parameter groups
    optimizer, scheduler = build_optimizer(groups, OptimConfig(lr=lr, warmup_steps=warmup, weight_decay=0.0), max_steps=0)
    for _ in range(steps):
        for p in params:
            p.grad = torch.ones_like(p)
        optimizer.step()
        scheduler.step()
    return optimizer, scheduler


def test_set_learning_rate_continues_the_schedule_as_if_started_at_the_new_rate():
    """Against torch itself: a run that started at the new rate, at the same step."""
    from lldslight.update.optim import set_learning_rate

    optimizer, scheduler = _warmed(1e-2, steps=2)
    rates = set_learning_rate(optimizer, scheduler, 4e-3)
    reference_opt, reference = _warmed(4e-3, steps=2)
    assert rates == pytest.approx([4e-3 * 3 / 4] * 2)  # warm-up multiplier at step 2 of 4: 3/4, by hand
    assert rates == pytest.approx([g["lr"] for g in reference_opt.param_groups])
    assert scheduler.get_last_lr() == pytest.approx(reference.get_last_lr())
    assert scheduler.last_epoch == reference.last_epoch == 2 and scheduler.base_lrs == [4e-3, 4e-3]
    for _ in range(3):  # and on, past the warm-up
        optimizer.step()
        scheduler.step()
        reference_opt.step()
        reference.step()
        assert scheduler.get_last_lr() == pytest.approx(reference.get_last_lr())
    assert scheduler.get_last_lr() == pytest.approx([4e-3, 4e-3])


def test_set_learning_rate_per_group_without_a_scheduler_and_bad_input():
    from lldslight.errors import ConfigError
    from lldslight.update.optim import set_learning_rate

    optimizer, scheduler = _warmed(1e-2, steps=5)
    assert set_learning_rate(optimizer, scheduler, [1e-3, 2e-3]) == pytest.approx([1e-3, 2e-3])  # past the warm-up: x 1
    assert set_learning_rate(optimizer, None, 5e-4) == [5e-4, 5e-4]
    assert [g["lr"] for g in optimizer.param_groups] == [5e-4, 5e-4]
    with pytest.raises(ConfigError, match=r"set_learning_rate lr must be one rate or 2 \(one per parameter group\)"):
        set_learning_rate(optimizer, scheduler, [1e-3])
    with pytest.raises(ConfigError, match="set_learning_rate scheduler must be a LambdaLR"):
        set_learning_rate(optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 1), 1e-3)


def test_optim_config_checks_its_fields():
    from lldslight.errors import ConfigError
    from lldslight.update.optim import OptimConfig

    assert OptimConfig(betas=[0.5, 0.6]).betas == (0.5, 0.6)  # YAML lists become tuples
    for field, bad, needle in (("lr", 0.0, "model.optim.lr must be > 0"), ("betas", (0.9,), "model.optim.betas must be two numbers"),
                               ("warmup_ratio", 2.0, "model.optim.warmup_ratio must be in [0, 1]"),
                               ("weight_decay", -1.0, "model.optim.weight_decay must be >= 0")):
        with pytest.raises(ConfigError, match=needle.replace("[", r"\[").replace("]", r"\]")):
            OptimConfig(**{field: bad})
    assert json.dumps(OptimConfig().warmup(100)) == "0" and OptimConfig(warmup_ratio=0.25).warmup(100) == 25


def test_the_configuration_page_documents_every_field_of_both_groups():
    import dataclasses

    from lldslight.update.optim import OptimConfig
    from lldslight.update import UpdateConfig

    page = (ROOT / "docs" / "configuration.md").read_text()
    for group, cls in (("update", UpdateConfig), ("optim", OptimConfig)):
        for f in dataclasses.fields(cls):
            assert f"| `model.{group}.{f.name}` |" in page, f"docs/configuration.md: model.{group}.{f.name}"
