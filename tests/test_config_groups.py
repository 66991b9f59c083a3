"""``model.update.*`` and ``model.optim.*``: the groups GRPOModule takes whole, the deprecated flat
keys they replace (one line each, one release), old checkpoints, the shipped configs converted to
the groups, and the one learning-rate setter (lldslight/optim.py, lldslight/deprecated_keys.py).

Each shipped config is compared with its flat form, written here by an independent inverse (the
groups' keys moved back up to ``model.``): both must resolve to the same UpdateConfig and
OptimConfig. The collapse lab's registered recipe is also checked against its values written out
by hand, and with the command line its registration uses (``-- --model.lr 5e-4``).
"""
from __future__ import annotations

import copy
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


def _flat(model: dict) -> dict:
    """The flat form of a ``model:`` mapping written with the groups: what the old code read."""
    from lldslight.deprecated_keys import GROUP_OF

    out = {k: v for k, v in model.items() if k not in ("update", "optim")}
    for group in ("update", "optim"):
        fields = model.get(group) or {}
        out.update({k: v for k, v in fields.items() if k in GROUP_OF})
        # A field added to a group after the flat release has no flat key: it stays in its group.
        newer = {k: v for k, v in fields.items() if k not in GROUP_OF}
        if newer:
            out[group] = newer
    return out


def _resolve(*models: dict):
    """GRPOModule built from ``model:`` mappings composed in order, as jsonargparse builds it from
    configs (no model is loaded): its (update_config, optim_config)."""
    from jsonargparse import ArgumentParser

    from lldslight.module import GRPOModule

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(GRPOModule, "model", fail_untyped=False)
    cfg = None
    for model in models:
        cfg = parser.parse_object({"model": model}, cfg)
    module = parser.instantiate_classes(cfg).model
    return module.update_config, module.optim_config


def _instantiate(args: list[str]):
    """The real CLI, built but not run (as tests/test_recipes.py does)."""
    from lldslight.cli import TRAINER_DEFAULTS, _cli_class

    cli_cls, module_cls, datamodule_cls = _cli_class()
    return cli_cls(module_cls, datamodule_cls, args=args, run=False, trainer_defaults=TRAINER_DEFAULTS,
                   seed_everything_default=0, auto_configure_optimizers=False, save_config_callback=None)


def _deprecation_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if " is deprecated: write model." in line]


# -- the shipped configs ------------------------------------------------------------------------------------


def test_every_shipped_config_was_found():
    names = {str(p.relative_to(ROOT)) for p in CONFIGS}
    assert {"configs/tiny.yaml", "lab/configs/constant.yaml", "lab/configs/arms/half_lr.yaml",
            "configs/recipes/qwen2.5-7b-base-grpo.yaml", "lab/configs/collapse.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=[str(p.relative_to(ROOT)) for p in CONFIGS])
def test_a_shipped_config_uses_the_groups_and_resolves_as_its_flat_form(path, capsys):
    from lldslight.deprecated_keys import GROUP_OF

    model = yaml.safe_load(path.read_text())["model"]
    assert not set(model) & set(GROUP_OF), f"{path.name}: flat keys {sorted(set(model) & set(GROUP_OF))}"
    base = []
    if "lab/configs/arms" in str(path):  # an arm composes after the lab's registered recipe
        base = [yaml.safe_load((ROOT / "lab/configs/constant.yaml").read_text())["model"]]
    grouped = _resolve(*base, model)
    flat = _resolve(*[_flat(m) for m in base], _flat(model))
    assert grouped == flat
    flat_keys = set(_flat(model)) & set(GROUP_OF)
    assert len(_deprecation_lines(capsys.readouterr().err)) == len(flat_keys | {k for m in base for k in _flat(m) if k in GROUP_OF})


def test_the_lab_recipe_keeps_its_values_and_its_registered_command_lines(tmp_path, capsys, monkeypatch):
    """lab/configs/constant.yaml and its arms, through the real CLI: the values of the recipe as
    registered (written out by hand here), and ``-- --model.lr 5e-4`` (the registration's command
    line) still sets the rate, with one deprecation line."""
    from lldslight.optim import OptimConfig
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
    assert not _deprecation_lines(capsys.readouterr().err)

    cli = _instantiate([*common, "--config", "lab/configs/arms/half_lr.yaml", "--model.lr", "5e-4"])
    assert cli.model.optim_config == OptimConfig(lr=5e-4, warmup_steps=30)  # the command line wins, as before
    assert cli.model.update_config == recipe
    assert _deprecation_lines(capsys.readouterr().err) == [
        "[lldslight] model.lr is deprecated: write model.optim.lr (the flat key is accepted for one more release)"]
    assert cli.config["model"]["lr"] is None and cli.config["model"]["optim"]["lr"] == 5e-4  # saved in the groups' form


def test_flat_keys_in_a_config_file_give_one_line_each_and_the_same_settings(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    tiny = yaml.safe_load((ROOT / "configs/tiny.yaml").read_text())
    old = copy.deepcopy(tiny)
    old["model"] = _flat(old["model"])
    (tmp_path / "old.yaml").write_text(yaml.safe_dump(old))
    args = ["--trainer.logger.init_args.save_dir", str(tmp_path)]
    new_cli = _instantiate(["--config", "configs/tiny.yaml", *args])
    assert not _deprecation_lines(capsys.readouterr().err)
    old_cli = _instantiate(["--config", str(tmp_path / "old.yaml"), *args])
    lines = _deprecation_lines(capsys.readouterr().err)
    assert sorted(lines) == sorted(f"[lldslight] model.{k} is deprecated: write model.{g}.{k} (the flat key is accepted for one more "
                                   "release)" for g in ("update", "optim") for k in tiny["model"][g])
    assert (old_cli.model.update_config, old_cli.model.optim_config) == (new_cli.model.update_config, new_cli.model.optim_config)
    assert old_cli.model.optim_config.lr == 1e-3 and old_cli.model.update_config.updates_per_rollout == 2


def test_python_keywords_fold_into_the_groups_and_save_the_groups_form(capsys):
    from lldslight.module import GRPOModule
    from lldslight.optim import OptimConfig
    from lldslight.update import UpdateConfig

    module = GRPOModule(update=UpdateConfig(kl_coef=0.0), lr=1e-3, updates_per_rollout=2)
    assert module.update_config == UpdateConfig(kl_coef=0.0, updates_per_rollout=2)
    assert module.optim_config == OptimConfig(lr=1e-3)
    assert len(_deprecation_lines(capsys.readouterr().err)) == 2
    assert module.hparams["lr"] is None and module.hparams["optim"] == OptimConfig(lr=1e-3)
    assert module.hparams["update"] == module.update_config


# -- checkpoints written before the groups ---------------------------------------------------------------------------


OLD_HPARAMS = {  # every hyper-parameter the flat GRPOModule saved (its signature's names), as LightningCLI wrote them
    "policy": None,  # filled in from tiny.yaml
    "lr": 2e-3, "weight_decay": 0.02, "betas": [0.8, 0.99], "warmup_steps": 3, "warmup_ratio": 0.0, "grad_clip": 0.5,
    "optimizer": "adamw", "updates_per_rollout": 2, "micro_batch_size": 2, "micro_batch_tokens": None,
    "reuse_onpolicy_logp": True, "old_logp_source": "recompute", "clip_eps": 0.3, "clip_eps_high": None, "ratio_clamp": None,
    "aggregation": "token-mean", "normalize_adv_std": True, "kl_coef": 0.01, "kl_estimator": "k1", "entropy_coef": 0.0,
    "logprob_temperature": 1.0, "logprob_chunk_size": None, "shuffle_minibatches": True, "minibatch_grouping": "rows",
    "negative_advantages": "keep", "fsdp": {"param_dtype": None, "reduce_dtype": None, "reshard_after_forward": True},
}


def _old_cli_checkpoint(path: Path) -> Path:
    """Hyper-parameters as LightningCLI saved them for the flat GRPOModule (no weights)."""
    hparams = dict(OLD_HPARAMS, policy=yaml.safe_load((ROOT / "configs/tiny.yaml").read_text())["model"]["policy"])
    hparams["_instantiator"] = "lightning.pytorch.cli.instantiate_module"
    torch.save({"state_dict": {}, "global_step": 1, "hyper_parameters": hparams}, path)
    return path


def test_an_old_checkpoints_flat_hyper_parameters_map_to_the_groups():
    from lldslight.deprecated_keys import nested
    from lldslight.optim import OptimConfig
    from lldslight.update import UpdateConfig

    groups = nested(OLD_HPARAMS)
    assert UpdateConfig(**groups["update"]) == UpdateConfig(
        grad_clip=0.5, updates_per_rollout=2, micro_batch_size=2, clip_eps=0.3, aggregation="token-mean", kl_coef=0.01, kl_estimator="k1")
    assert OptimConfig(**groups["optim"]) == OptimConfig(lr=2e-3, weight_decay=0.02, betas=(0.8, 0.99), warmup_steps=3)
    assert set(groups) == {"policy", "logprob_temperature", "logprob_chunk_size", "fsdp", "update", "optim"}


@pytest.mark.slow
def test_a_checkpoint_written_before_the_groups_resumes(tmp_path):
    """A real checkpoint rewritten to the old form (every setting flat, no groups) resumes: its
    settings land in the groups silently (the user did not write them), the resume line names what
    differs by its new key, and the scheduler goes on at the checkpoint's rate."""
    from test_resume import metrics, resume_fit, resume_lines

    run = tmp_path / "run"
    first = resume_fit(tmp_path, "first", run, 1)
    assert first.returncode == 0, first.stderr[-3000:]
    ckpt = run / "tiny" / "version_0" / "checkpoints" / "last.ckpt"
    saved = torch.load(ckpt, weights_only=True)
    hparams = saved["hyper_parameters"]
    assert hparams["optim"]["lr"] == 1e-3 and hparams["lr"] is None  # the groups' form
    # An old checkpoint holds the old release's flat keys only: fields added to a group since have none.
    from lldslight.deprecated_keys import GROUP_OF

    flat = {k: v for k, v in {**hparams["update"], **hparams["optim"]}.items() if k in GROUP_OF}
    saved["hyper_parameters"] = {**{k: v for k, v in hparams.items() if k not in ("update", "optim")}, **flat}
    torch.save(saved, ckpt)

    resumed = resume_fit(tmp_path, "resumed", run, 2, "--ckpt_path", "last", "--model.update.clip_eps", "0.1")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert not _deprecation_lines(resumed.stderr)
    assert resume_lines(resumed) == [
        f"[lldslight] resuming from {ckpt}: 1 setting(s) taken from the checkpoint, not your config: "
        "model.update.clip_eps=0.2 (yours: 0.1); --resume_override model.update.clip_eps (or all) uses yours"]
    # warm-up 4 steps: step 1 (0-based) runs at 2/4 of the rate
    assert metrics(run / "tiny" / "version_1" / "metrics.csv")[1]["train/lr"] == pytest.approx(1e-3 * 2 / 4, rel=1e-6)


def test_an_old_checkpoint_loads_with_load_from_checkpoint(tmp_path):
    """GRPOModule.load_from_checkpoint rebuilds the module from the saved hyper-parameters through
    the instantiator a CLI checkpoint names (before loading weights): the flat ones fold into the groups."""
    from lightning.pytorch.cli import instantiate_module

    from lldslight.module import GRPOModule

    ckpt = _old_cli_checkpoint(tmp_path / "old.ckpt")
    hparams = torch.load(ckpt, weights_only=True)["hyper_parameters"]
    module = instantiate_module(GRPOModule, {k: v for k, v in hparams.items() if k != "_instantiator"})
    assert module.optim_config.lr == 2e-3 and module.optim_config.betas == (0.8, 0.99)
    assert module.update_config.kl_estimator == "k1" and module.update_config.clip_eps == 0.3


# -- the learning-rate setter ----------------------------------------------------------------------------------------


def _warmed(lr: float, steps: int, warmup: int = 4):
    from lldslight.optim import OptimConfig, build_optimizer

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
    from lldslight.optim import set_learning_rate

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
    from lldslight.optim import set_learning_rate

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
    from lldslight.optim import OptimConfig

    assert OptimConfig(betas=[0.5, 0.6]).betas == (0.5, 0.6)  # YAML lists become tuples
    for field, bad, needle in (("lr", 0.0, "model.optim.lr must be > 0"), ("betas", (0.9,), "model.optim.betas must be two numbers"),
                               ("warmup_ratio", 2.0, "model.optim.warmup_ratio must be in [0, 1]"),
                               ("weight_decay", -1.0, "model.optim.weight_decay must be >= 0")):
        with pytest.raises(ConfigError, match=needle.replace("[", r"\[").replace("]", r"\]")):
            OptimConfig(**{field: bad})
    assert json.dumps(OptimConfig().warmup(100)) == "0" and OptimConfig(warmup_ratio=0.25).warmup(100) == 25


def test_the_configuration_page_documents_every_field_of_both_groups():
    import dataclasses

    from lldslight.optim import OptimConfig
    from lldslight.update import UpdateConfig

    page = (ROOT / "docs" / "configuration.md").read_text()
    for group, cls in (("update", UpdateConfig), ("optim", OptimConfig)):
        for f in dataclasses.fields(cls):
            assert f"| `model.{group}.{f.name}` |" in page, f"docs/configuration.md: model.{group}.{f.name}"
