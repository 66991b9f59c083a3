"""The update owns its interface, and callbacks hand over through declared, typed names
(docs/architecture.md, Interfaces):

- update/train.py's ``UpdateConfig`` holds the update's settings (defaults defined there only) and
  ``Learner`` what it needs from a model; GRPOModule is a Learner and builds its UpdateConfig once;
- nothing in lldslight reads a hyper-parameter with ``hparams.get(key, default)`` (a second default);
- callbacks set no attribute on the module that ``GRPOModule.__init__`` does not declare (read from
  the source, and watched during a real fit), and reach no private name of another module.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, tiny_policy_config

PACKAGE = ROOT / "lldslight"
MODULE_FILE = PACKAGE / "module.py"


def _sources(folder: Path | None = None):
    for path in sorted((folder or PACKAGE).rglob("*.py")):
        yield path, ast.parse(path.read_text(), str(path))


def _declared() -> set[str]:
    from lldslight.module import GRPOModule

    module = GRPOModule(policy=tiny_policy_config())
    return set(vars(module)) | set(module._modules) | set(module._parameters) | set(module._buffers)


# -- the update's interface ------------------------------------------------------------------------------


def test_the_module_is_a_learner_with_the_update_config_it_is_given():
    from lldslight.module import GRPOModule
    from lldslight.update import Learner, UpdateConfig

    given = UpdateConfig(updates_per_rollout=3, kl_coef=0.0, micro_batch_tokens=64)
    module = GRPOModule(policy=tiny_policy_config(), update=given)
    assert isinstance(module, Learner)
    config = module.update_config
    assert config == given and module.hparams["update"] == given  # taken whole, saved whole
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.kl_coef = 1.0  # changes go through reconfigure_update
    module.reconfigure_update(updates_per_rollout=1, kl_coef=0.05)
    assert (module.update_config.updates_per_rollout, module.update_config.kl_coef) == (1, 0.05)
    assert (module.hparams["update"].updates_per_rollout, module.hparams["update"].kl_coef) == (1, 0.05)  # saved with checkpoints
    # Under LightningCLI the saved hyper-parameters are the config's mappings: they change alike.
    module.hparams["update"] = dataclasses.asdict(given)
    module.reconfigure_update(kl_coef=0.5)
    assert module.hparams["update"]["kl_coef"] == 0.5 and module.hparams["update"]["updates_per_rollout"] == 1
    with pytest.raises(ValueError, match="model.update.kl_coef must be >= 0"):
        module.reconfigure_update(kl_coef=-1.0)


def test_update_choice_sets_are_defined_once_and_checked():
    """A group refuses a value outside its choices (the Literal choice sets: update/train.py's,
    objectives.py's, optim.py's), naming the key and the choices."""
    import typing

    from lldslight.errors import ConfigError
    from lldslight.module import GRPOModule
    from lldslight.update.optim import OptimConfig
    from lldslight.update import UpdateConfig

    update_types = typing.get_type_hints(UpdateConfig)
    for key, bad in (("aggregation", "mean"), ("kl_estimator", "k2"), ("old_logp_source", "cache"),
                     ("minibatch_grouping", "groups"), ("negative_advantages", "flip")):
        choices = typing.get_args(update_types[key])
        with pytest.raises(ConfigError, match=rf"model\.update\.{key} must be one of .*{choices[0]}.*got '{bad}'"):
            UpdateConfig(**{key: bad})
    with pytest.raises(ConfigError, match=r"model\.optim\.optimizer must be 'adamw' or 'adamw8bit', got 'sgd'"):
        GRPOModule(policy=tiny_policy_config(), optim=OptimConfig(optimizer="sgd"))


def test_the_groups_are_taken_whole_and_documented():
    """GRPOModule takes UpdateConfig and OptimConfig whole (a field added to one is a YAML key with
    no forwarding code), each field keeps its default in its dataclass only, and every field is
    typed and documented (an attribute docstring after it, as litgpt's TrainArgs); the old
    release's flat keys are each a field of their group and no argument of GRPOModule's."""
    from lldslight.run.deprecated_keys import GROUP_OF
    from lldslight.module import GRPOModule
    from lldslight.update.optim import OptimConfig
    from lldslight.update import UpdateConfig

    params = inspect.signature(GRPOModule.__init__).parameters
    assert params["update"].default == UpdateConfig() and params["optim"].default == OptimConfig()
    groups = {"update": {f.name for f in dataclasses.fields(UpdateConfig)}, "optim": {f.name for f in dataclasses.fields(OptimConfig)}}
    assert len(GROUP_OF) == 23 and all(key in groups[group] for key, group in GROUP_OF.items())  # the old release's flat keys
    assert set(params) == {"self", "policy", "update", "optim", "logprob_temperature", "logprob_chunk_size", "fsdp"}
    for path, cls in ((PACKAGE / "update" / "train.py", "UpdateConfig"), (PACKAGE / "update" / "optim.py", "OptimConfig")):
        body = next(n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef) and n.name == cls).body
        for i, stmt in enumerate(body):
            if isinstance(stmt, ast.AnnAssign):
                doc = body[i + 1] if i + 1 < len(body) else None
                assert isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str), \
                    f"{cls}.{stmt.target.id} has no docstring"


def test_update_does_not_know_the_module():
    tree = ast.parse((PACKAGE / "update" / "train.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert "lldslight.module" not in imported and "lldslight.callbacks" not in imported


def test_no_hparams_get_with_a_default_anywhere():
    """Reading ``hparams.get(key, default)`` (or ``hp.get``) repeats a default defined elsewhere."""
    found = []
    for path, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
                owner = ast.unparse(node.func.value)
                if owner.split(".")[-1] in ("hparams", "hp", "hyper_parameters") or owner.endswith("hparams"):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "hparams read with .get (use module.update_config or a declared attribute):\n" + "\n".join(found)


# -- what callbacks may touch on the module --------------------------------------------------------------


def _module_assignments():
    """(file:line, attribute) of every ``pl_module.X = ...`` / ``module.X += ...`` / ``ctx.module.X = ...``
    outside module.py."""
    for path, tree in _sources():
        if path == MODULE_FILE:
            continue
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                if isinstance(t, ast.Attribute) and ast.unparse(t.value).split(".")[-1] in ("pl_module", "module"):
                    yield f"{path.relative_to(ROOT)}:{node.lineno}", t.attr


def test_callbacks_assign_only_declared_module_attributes():
    declared = _declared()
    sites = list(_module_assignments())
    assert any(name == "vetoed_updates" for _, name in sites), "the scan found nothing: it would pass vacuously"
    undeclared = [f"{where}: {name}" for where, name in sites if name not in declared]
    assert not undeclared, "attributes set on the module but not declared in GRPOModule.__init__:\n" + "\n".join(undeclared)


def test_callbacks_reach_no_private_name_of_another_module():
    # A rate change goes through lldslight.update.optim.set_learning_rate. Two of Lightning's own private
    # names, where it has no public view (callbacks/step_row.py says why): the row of logged values
    # before the loggers get it, and the step number the loggers write.
    allowed: set = {("trainer", "_logger_connector"), ("trainer.fit_loop.epoch_loop", "_batches_that_stepped")}
    found = []
    for path, tree in _sources(PACKAGE / "callbacks"):
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                owner = ast.unparse(node.value)
                if owner not in ("self", "cls", "super()") and (owner, node.attr) not in allowed:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {owner}.{node.attr}")
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if alias.name.startswith("_") and (f"import {node.module}", alias.name) not in allowed:
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno}: from {node.module} import {alias.name}")
    assert not found, "\n".join(found)


def test_receive_rollout_is_the_hand_off(fixed_traj):
    from lldslight.module import GRPOModule

    module = GRPOModule(policy=tiny_policy_config())
    module.receive_rollout(fixed_traj, timings={"rollout_s": 1.5})
    assert module.rollout_batch is fixed_traj and module.eval_batch is None and module.timings == {"rollout_s": 1.5}
    module.receive_rollout(fixed_traj, "eval")
    assert module.eval_batch is fixed_traj
    with pytest.raises(ValueError, match=r"receive_rollout stage must be one of \('train', 'eval'\)"):
        module.receive_rollout(fixed_traj, "val")


@pytest.fixture
def fixed_traj():
    from lldslight.trajectory import Trajectory

    B, T = 2, 6
    return Trajectory(
        input_ids=torch.ones(B, T, dtype=torch.long), attention_mask=torch.ones(B, T, dtype=torch.long),
        prompt_len=torch.full((B,), 2), loss_mask=torch.ones(B, T, dtype=torch.bool), action_id=torch.zeros(B, T, dtype=torch.long),
        answer_mask=torch.zeros(B, T, dtype=torch.bool), group_id=torch.zeros(B, dtype=torch.long), reward=torch.tensor([1.0, 0.0]),
        num_searches=torch.zeros(B, dtype=torch.long), num_invalid=torch.zeros(B, dtype=torch.long),
        num_actions=torch.ones(B, dtype=torch.long), finish_reason=["answer"] * B, data_source=["t"] * B, responses=[""] * B,
    )


# -- a real fit with every callback that touches the module ----------------------------------------------


SET: list[tuple[str, str]] = []  # (file, attribute) of every attribute lldslight code outside module.py set


def _recording_module(**kwargs):
    from lldslight.module import GRPOModule

    class Recording(GRPOModule):
        def __setattr__(self, name, value):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(str(PACKAGE)) and Path(caller) != MODULE_FILE:
                SET.append((str(Path(caller).relative_to(ROOT)), name))
            super().__setattr__(name, value)

    return Recording(**kwargs)


@pytest.mark.slow
def test_a_fit_sets_only_declared_attributes(tmp_path, synth_kb, bm25):
    import lightning.pytorch as pl

    from lldslight.callbacks import LLDS, CollapseAlarm, GradientSpikeGuard, Heal, LLDMonitor, RunSummary, SearchRollout
    from lldslight.data.datamodule import SearchQADataModule
    from lldslight.rollout import RolloutConfig
    from lldslight.update.optim import OptimConfig
    from lldslight.update import UpdateConfig

    class HealAtStep1(pl.Callback):
        """Heal's rollback and remedies (a reference for KL under full fine-tuning, fewer updates)."""

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 2:
                heal = next(c for c in trainer.callbacks if isinstance(c, Heal))
                assert heal.heal_now(trainer, pl_module, step=1, onset=1, reason="test")

    SET.clear()
    declared = _declared()
    pl.seed_everything(0)
    module = _recording_module(policy=tiny_policy_config(lora=False), optim=OptimConfig(lr=1e-3),
                               update=UpdateConfig(updates_per_rollout=2, micro_batch_size=4, kl_coef=0.0))
    after_init = set(vars(module))
    rollout = RolloutConfig(group_size=2, max_turns=1, max_new_tokens=6, max_obs_tokens=16, max_response_tokens=40, topk=1)
    callbacks = [
        SearchRollout(retriever=bm25, rollout=rollout, eval_max_turns=1, eval_before_fit=True, eval_after_fit=True),
        LLDS(), LLDMonitor(plot=False), GradientSpikeGuard(warmup=0), CollapseAlarm(),
        Heal(every=1, margin=0, updates_factor=0.5, kl_coef=0.05, print_heals=False), HealAtStep1(), RunSummary(path=str(tmp_path / "summary.json")),
    ]
    data = SearchQADataModule(train_files=[str(synth_kb["train"])], val_files=[str(synth_kb["dev"])], batch_size=2,
                              eval_batch_size=3, limit_val=3)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=3, logger=False, callbacks=callbacks, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0, limit_val_batches=1,
        val_check_interval=3, default_root_dir=str(tmp_path),
    )
    trainer.fit(module, datamodule=data)
    assert module.update_config.updates_per_rollout == 1 and module.reference is not None  # the heal happened
    assert set(module.eval_history) == {"before", "after"} and module.last_eval  # both evaluation paths ran
    # RunSummary's paired EM change: the same 3 dev questions before and after, differenced by hand.
    import json

    import os

    import torch

    written = json.loads((tmp_path / "summary.json").read_text())
    change = written["dev_em_change"]
    # The machine its times hold on; no launcher set a start, so no whole-command time.
    assert written["machine"]["threads"] == torch.get_num_threads() and written["machine"]["cpu_flags_simd"] is not None
    assert written["command_time_s"] is None or "LLDSLIGHT_STARTED_AT" in os.environ
    before = {r["question"]: r["em"] for r in module.eval_history["before"]["records"]}
    after = {r["question"]: r["em"] for r in module.eval_history["after"]["records"]}
    assert change["n"] == len(before) == 3 and change["change"] == sum(after[q] - before[q] for q in before) / 3
    # The hand-off and reconfigure_update run in module.py; Heal's rollback sets these from heal.py.
    assert {"rng_after_step", "reference"} <= {name for _, name in SET}, SET
    undeclared = sorted({f"{where}: {name}" for where, name in SET if name not in declared})
    assert not undeclared, "set on the module during fit but not declared in GRPOModule.__init__:\n" + "\n".join(undeclared)
    new_public = sorted(k for k in set(vars(module)) - after_init if not k.startswith("_"))
    assert not new_public, f"public attributes that appeared during fit: {new_public}"
