"""The paper recipes (configs/recipes/*.yaml) parse through the real CLI, print their config, hold
the paper's hyper-parameters (docs/configuration.md, Paper recipes), and instantiate (model swapped for the tiny one,
on CPU, one device) without training."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT, TINY_DIMS

RECIPES = sorted((ROOT / "configs" / "recipes").glob("*.yaml"))
EXPECTED = {
    "qwen2.5-3b-instruct-grpo", "qwen2.5-3b-instruct-llds", "qwen2.5-3b-base-grpo", "qwen2.5-3b-base-llds",
    "qwen2.5-7b-instruct-grpo", "qwen2.5-7b-instruct-llds", "qwen2.5-7b-base-grpo", "qwen2.5-7b-base-llds",
}


def _instantiate(args: list[str]):
    """The recipe through the real CLI, built but not run (what `lldslight fit` would construct)."""
    from lldslight.cli.lightning import TRAINER_DEFAULTS, _cli_class

    cli_cls, module_cls, datamodule_cls = _cli_class()
    return cli_cls(
        module_cls,
        datamodule_cls,
        args=args,
        run=False,
        trainer_defaults=TRAINER_DEFAULTS,
        seed_everything_default=0,
        auto_configure_optimizers=False,
        save_config_callback=None,
    )


def test_every_paper_recipe_is_there():
    assert EXPECTED <= {p.stem for p in RECIPES}


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_prints_its_config(recipe, capsys):
    from lldslight.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", str(recipe), "--print_config"])
    assert exit_.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["policy"]["model"].startswith("Qwen/Qwen2.5-")


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_has_the_paper_hyperparameters_and_instantiates(recipe, tmp_path):
    from lldslight.callbacks import LLDS, SearchRollout
    from lldslight.policy.distributed import FSDP2Strategy
    from lldslight.retrieval import HttpRetriever

    raw = yaml.safe_load(recipe.read_text())
    strategy = raw["trainer"]["strategy"]
    assert strategy["class_path"] == "lldslight.policy.distributed.FSDP2Strategy"
    assert isinstance(FSDP2Strategy(**strategy.get("init_args", {})), FSDP2Strategy)
    gpus = raw["trainer"]["devices"] * raw["trainer"]["num_nodes"]
    assert gpus == 4

    cli = _instantiate([
        "--config", str(recipe),
        "--model.policy.model", "smollm2-135m-instruct",
        "--model.policy.random_init", json.dumps(TINY_DIMS),
        "--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.strategy", "auto",
        "--trainer.logger.init_args.save_dir", str(tmp_path),
    ])
    hp, opt = cli.model.update_config, cli.model.optim_config
    assert (opt.lr, opt.weight_decay, opt.warmup_ratio, hp.grad_clip) == (1e-6, 0.01, 0.285, 1.0)
    assert (hp.kl_coef, hp.kl_estimator, hp.entropy_coef, hp.clip_eps) == (0.001, "k3", 0.0, 0.2)
    assert hp.aggregation == "seq-mean-token-mean" and cli.model.policy_config.lora is None  # full fine-tuning
    assert (cli.model.fsdp_config.param_dtype, cli.model.fsdp_config.reduce_dtype) == ("bfloat16", "float32")
    assert cli.trainer.max_steps == 1005
    prompts = cli.datamodule.batch_size * gpus
    rollout = next(c for c in cli.trainer.callbacks if isinstance(c, SearchRollout))
    r = rollout.config
    assert prompts == 512 and r.group_size == 5
    assert prompts * r.group_size // hp.updates_per_rollout == 256  # 2560 rollouts in mini-batches of 256
    assert (r.max_turns, r.topk, r.max_new_tokens, r.max_obs_tokens, r.max_response_tokens) == (3, 3, 500, 500, 4096)
    assert rollout.eval_config.max_turns == 4
    assert isinstance(rollout.retriever, HttpRetriever) and rollout.retriever.url.startswith("http")
    llds = [c for c in cli.trainer.callbacks if isinstance(c, LLDS)]
    if "-grpo" in recipe.stem:
        assert not llds
    else:
        assert len(llds) == 1 and llds[0].gate == "action"
        assert llds[0].coef == (0.3 if "7b-instruct" in recipe.stem else 0.2)
        assert llds[0].answer_masking == ("paper" if recipe.stem.endswith("-llds-ma") else "off")

    cli.model.configure_model()  # the tiny stand-in builds; full fine-tuning keeps a frozen reference
    assert cli.model.reference is not None
    assert all(p.requires_grad for p in cli.model.policy.parameters())


def test_qlora_overlay_composes_with_a_recipe(tmp_path):
    from lightning.pytorch.strategies import DDPStrategy

    cli = _instantiate([
        "--config", str(ROOT / "configs" / "recipes" / "qwen2.5-7b-instruct-llds.yaml"),
        "--config", str(ROOT / "configs" / "qlora.yaml"),
        "--trainer.accelerator", "cpu", "--trainer.devices", "1",
        "--trainer.logger.init_args.save_dir", str(tmp_path),
    ])
    policy = cli.model.policy_config
    assert (policy.quantization, policy.precision, policy.dtype, policy.lora.r) == ("nf4", "auto", None, 64)
    assert cli.model.optim_config.optimizer == "adamw8bit"
    assert isinstance(cli.trainer.strategy, DDPStrategy)
