"""Dynamic sampling (SearchRollout(dynamic_sampling=...), DAPO): real tiny fits with a reward the test
controls; the refill stream of the datamodule; two processes that must stay in step."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pandas as pd
import pytest
import torch

from conftest import ROOT, tiny_policy_config
from run_helpers import CountGenerate, SplitReward
from lldslight.update import UpdateConfig
from lldslight.update.optim import OptimConfig

G = 4
BATCH = 2


def _groups(rewards: list[float], group_ids: list[int]) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for g, r in zip(group_ids, rewards):
        out.setdefault(g, []).append(r)
    return out


def fit(tmp_path, synth_kb, bm25, reward, max_rounds: int, steps: int = 2, seed: int = 0, via_callback: bool = False) -> dict:
    """A real fit of the tiny model with dynamic sampling; returns the recorder and metrics.csv."""
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    from lldslight.callbacks import SearchRollout, SearchRolloutOptions
    from lldslight.data.datamodule import SearchQADataModule
    from lldslight.rollout.dynamic_sampling import DynamicSamplingConfig
    from lldslight.module import GRPOModule
    from lldslight.rollout import RolloutConfig

    pl.seed_everything(seed)
    rollout = RolloutConfig(group_size=G, max_turns=1, max_new_tokens=6, max_obs_tokens=16, max_response_tokens=40, topk=1)
    option = DynamicSamplingConfig() if via_callback else DynamicSamplingConfig(enabled=True, max_rounds=max_rounds)
    callbacks = [CountGenerate(str(tmp_path / "calls")), SearchRollout(retriever=bm25, reward=reward, rollout=rollout, dynamic_sampling=option)]
    if via_callback:  # as a config composed on top sets it (configs/dynamic_sampling.yaml)
        callbacks.append(SearchRolloutOptions(dynamic_sampling=DynamicSamplingConfig(enabled=True, max_rounds=max_rounds)))
    module = GRPOModule(policy=tiny_policy_config(), update=UpdateConfig(updates_per_rollout=1, micro_batch_size=8, kl_coef=0.0), optim=OptimConfig(lr=1e-3))
    data = SearchQADataModule(train_files=[str(synth_kb["train"])], batch_size=BATCH, seed=seed)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, logger=CSVLogger(str(tmp_path), name="ds"), callbacks=callbacks,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        num_sanity_val_steps=0, log_every_n_steps=1, limit_val_batches=0,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, datamodule=data)
    metrics = pd.read_csv(Path(trainer.log_dir) / "metrics.csv").groupby("step").first()
    return {"steps": callbacks[0].steps, "metrics": metrics, "warnings": [str(w.message) for w in caught], "data": data}


def test_batch_is_filled_only_with_mixed_groups(tmp_path, synth_kb, bm25) -> None:
    reward = SplitReward(tie_every=3)
    run = fit(tmp_path, synth_kb, bm25, reward, max_rounds=8, via_callback=True)
    examples = {e.group_id: e for e in run["data"].train_examples}
    dropped = 0
    for step, rec in enumerate(run["steps"]):
        groups = _groups(rec["reward"], rec["group_id"])
        assert len(groups) == BATCH and rec["rows"] == BATCH * G, f"step {step}: the batch is not full"
        for g, rewards in groups.items():
            assert len(rewards) == G and max(rewards) > min(rewards), f"step {step}: group {g} has equal rewards"
            assert not reward.tied(examples[g].golden_answers)
        # Every mixed group the rounds produced is in the batch until it is full (sampling order).
        sampled_mixed = [g for call in rec["calls"] for g, r in _groups(call["reward"], call["group_id"]).items() if max(r) > min(r)]
        assert list(groups) == list(dict.fromkeys(sampled_mixed))[:BATCH]
        dropped += sum(len(_groups(c["reward"], c["group_id"])) for c in rec["calls"]) - BATCH
        row = run["metrics"].loc[step]
        assert row["rollout/rounds"] == len(rec["calls"]) and row["rollout/kept_groups"] == BATCH
        assert row["rollout/filled"] == 1.0 and row["train/zero_var_groups"] == 0.0
        assert row["rollout/dropped_groups"] == sum(len(_groups(c["reward"], c["group_id"])) for c in rec["calls"]) - BATCH
    assert dropped > 0, "nothing was filtered: the test would not tell dynamic sampling from plain sampling"
    assert not any("dynamic sampling at step" in w for w in run["warnings"])


def test_round_limit_trains_on_what_it_has_and_says_so_once(tmp_path, synth_kb, bm25) -> None:
    from lldslight.data.datamodule import SearchQADataModule

    # Only the first prompt of the first batch can have mixed rewards: step 0 ends with 1 mixed group
    # of 2 after the round limit; step 1 has none at all (its first round is trained on as sampled).
    probe = SearchQADataModule(train_files=[str(synth_kb["train"])], batch_size=BATCH, seed=0)
    first = next(iter(probe.train_dataloader()))[0]

    class OnePrompt(SplitReward):
        def tied(self, golden_answers):
            return golden_answers != first.golden_answers

    max_rounds = 2
    run = fit(tmp_path, synth_kb, bm25, OnePrompt(), max_rounds=max_rounds)
    step0, step1 = run["steps"]
    assert len(step0["calls"]) == len(step1["calls"]) == 1 + max_rounds
    assert max(step0["calls"][0]["reward"][:G]) > min(step0["calls"][0]["reward"][:G]), "seed gave a tied group: vacuous"
    assert step0["group_id"] == [first.group_id] * G and step0["rows"] == G
    assert step1["group_id"] == step1["calls"][0]["group_id"] and step1["rows"] == BATCH * G
    m = run["metrics"]
    assert m.loc[0, "rollout/filled"] == 0.5 and m.loc[0, "rollout/kept_groups"] == 1
    assert m.loc[1, "rollout/filled"] == 0.0 and (m["rollout/rounds"] == 1 + max_rounds).all()
    assert m.loc[0, "rollout/dropped_groups"] == (1 + max_rounds) * BATCH - 1
    said = [w for w in run["warnings"] if "dynamic sampling at step" in w]
    assert len(said) == 1 and "only 1 of 2 groups" in said[0]


def test_same_seed_same_rows(tmp_path, synth_kb, bm25) -> None:
    a = fit(tmp_path / "a", synth_kb, bm25, SplitReward(), max_rounds=4)
    b = fit(tmp_path / "b", synth_kb, bm25, SplitReward(), max_rounds=4)
    assert [s["input_ids"] for s in a["steps"]] == [s["input_ids"] for s in b["steps"]]
    assert [s["calls"] for s in a["steps"]] == [s["calls"] for s in b["steps"]]
    assert any(len(s["calls"]) > 1 for s in a["steps"]), "no extra round: the check would not cover the refill"


def test_refill_stream_is_deterministic_distinct_and_resumes(synth_kb) -> None:
    from lldslight.data.datamodule import SearchQADataModule

    def dm():
        return SearchQADataModule(train_files=[str(synth_kb["train"])], batch_size=BATCH, seed=0, limit_train=10)

    def draw(data, calls: int) -> list[list[int]]:
        return [[e.group_id for e in data.refill_prompts(4)] for _ in range(calls)]

    draws = draw(dm(), 4)
    assert draw(dm(), 4) == draws
    # 10 prompts, 4 per call: two calls per pass over a fresh order, each call distinct prompts.
    assert all(len(set(d)) == 4 for d in draws) and not set(draws[0]) & set(draws[1])
    assert draws[2:] != draws[:2], "the second pass reuses the first pass's order"
    main_order = [e.group_id for batch in list(dm().train_dataloader())[:2] for e in batch]
    assert main_order != draws[0], "the refill stream repeats the main order"
    # Resume: a checkpointed position continues the same draws.
    saved = dm()
    draw(saved, 2)
    fresh = dm()
    fresh.load_state_dict(saved.state_dict())
    assert draw(fresh, 2) == draws[2:]
    with pytest.raises(ValueError, match="refill_prompts"):
        dm().refill_prompts(11)


def test_a_group_of_one_is_refused_before_training(synth_kb, bm25) -> None:
    import lightning.pytorch as pl

    from lldslight.callbacks import SearchRollout, SearchRolloutOptions
    from lldslight.data.datamodule import SearchQADataModule
    from lldslight.rollout.dynamic_sampling import DynamicSamplingConfig
    from lldslight.module import GRPOModule
    from lldslight.rollout import RolloutConfig

    rollout = SearchRollout(retriever=bm25, rollout=RolloutConfig(group_size=1, max_new_tokens=4))
    options = SearchRolloutOptions(dynamic_sampling=DynamicSamplingConfig(enabled=True))
    trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, callbacks=[rollout, options],
                         enable_progress_bar=False, enable_checkpointing=False, limit_val_batches=0)
    data = SearchQADataModule(train_files=[str(synth_kb["train"])], batch_size=BATCH)
    with pytest.raises(ValueError, match="group_size must be >= 2 for training"):  # SearchRollout.setup, any training
        trainer.fit(GRPOModule(policy=tiny_policy_config()), datamodule=data)
    assert rollout._train_engine is None  # refused before any sampling


def test_mixed_groups_on_hand_built_rewards() -> None:
    from lldslight.callbacks.dynamic_sampling import DynamicSamplingConfig, mixed_groups  # the old home re-exports them

    reward = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.5, 0.0, 1.0, 1.0, 7.0])
    group = torch.tensor([5, 5, 3, 3, 3, 9, 9, 2, 8])
    assert mixed_groups(reward, group) == ([3, 9], [5, 2, 8])
    with pytest.raises(ValueError, match="max_rounds"):
        DynamicSamplingConfig(enabled=True, max_rounds=-1)


# -- configuration: the option, composed on top, and the deprecated callback ---------------------------


def _instantiate(*configs: str):
    """The objects LightningCLI builds from ``configs`` (nothing runs)."""
    from lightning.pytorch.cli import LightningCLI

    from lldslight.cli.lightning import TRAINER_DEFAULTS
    from lldslight.data.datamodule import SearchQADataModule
    from lldslight.module import GRPOModule

    args = [a for c in configs for a in ("--config", c)]
    return LightningCLI(GRPOModule, SearchQADataModule, args=args, run=False, trainer_defaults=TRAINER_DEFAULTS,
                        save_config_callback=None, auto_configure_optimizers=False)


def _rollout_after_setup(cli):
    from lldslight.callbacks import SearchRollout

    for cb in cli.trainer.callbacks:
        if type(cb).__name__ in ("SearchRolloutOptions", "DynamicSampling"):
            cb.setup(cli.trainer, cli.model, "fit")
    return next(cb for cb in cli.trainer.callbacks if isinstance(cb, SearchRollout))


def test_the_composed_config_sets_the_searchrollout_option_without_deprecation(monkeypatch) -> None:
    from lldslight.rollout.dynamic_sampling import DynamicSamplingConfig

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["lldslight"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli = _instantiate("configs/tiny.yaml", "configs/dynamic_sampling.yaml")
    assert not [w for w in caught if "DynamicSampling" in str(w.message)]  # the shipped config uses no deprecated name
    assert _rollout_after_setup(cli).dynamic_sampling == DynamicSamplingConfig(enabled=True, max_rounds=4)


def test_the_deprecated_callback_still_works_from_yaml_and_names_the_option(monkeypatch, tmp_path) -> None:
    from lldslight.rollout.dynamic_sampling import DynamicSamplingConfig

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["lldslight"])
    old = tmp_path / "old.yaml"
    old.write_text("trainer:\n  callbacks+:\n    - class_path: lldslight.callbacks.DynamicSampling\n      init_args: {max_rounds: 2}\n")
    with pytest.warns(DeprecationWarning, match=r"DynamicSampling is deprecated: .*SearchRollout's option `dynamic_sampling"):
        cli = _instantiate("configs/tiny.yaml", str(old))
    assert _rollout_after_setup(cli).dynamic_sampling == DynamicSamplingConfig(enabled=True, max_rounds=2)


def test_an_option_set_in_two_places_differently_is_refused(bm25) -> None:
    from types import SimpleNamespace

    from lldslight.callbacks import SearchRollout, SearchRolloutOptions
    from lldslight.rollout.dynamic_sampling import DynamicSamplingConfig

    own = SearchRollout(retriever=bm25, dynamic_sampling=DynamicSamplingConfig(enabled=True, max_rounds=2))
    same = SearchRolloutOptions(dynamic_sampling=DynamicSamplingConfig(enabled=True, max_rounds=2))
    same.setup(SimpleNamespace(callbacks=[own, same]), None, "fit")  # the same value twice is fine
    other = SearchRolloutOptions(dynamic_sampling=DynamicSamplingConfig(enabled=True, max_rounds=4))
    with pytest.raises(ValueError, match="set it in one place"):
        other.setup(SimpleNamespace(callbacks=[own, other]), None, "fit")
    with pytest.raises(ValueError, match="exactly one SearchRollout"):
        other.setup(SimpleNamespace(callbacks=[other]), None, "fit")


TWO_RANKS = """
trainer:
  devices: 2
  strategy: {strategy}
  max_steps: 3
  callbacks:
    - class_path: run_helpers.CountGenerate
      init_args: {{out_dir: {out}}}
    - class_path: lldslight.callbacks.SearchRollout
      init_args:
        retriever:
          class_path: lldslight.retrieval.BM25Retriever
          init_args: {{corpus: .lldslight/tiny_data/corpus.jsonl}}
        reward: {{class_path: run_helpers.SplitReward, init_args: {{tie_every: 2}}}}
        rollout: {{group_size: 4, max_turns: 1, max_new_tokens: 6, max_obs_tokens: 16, max_response_tokens: 40, topk: 1}}
model:
  update: {{updates_per_rollout: 2, micro_batch_size: 4}}
"""


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "{class_path: lldslight.policy.distributed.FSDP2Strategy}"], ids=["ddp", "fsdp2"])
def test_two_ranks_stay_in_step(tmp_path, strategy) -> None:
    """2 processes (gloo) with configs/dynamic_sampling.yaml composed on top: every step, both ranks
    call generate equally often (under FSDP2 each call gathers the sharded weights collectively: a
    mismatch would hang) and train on equally many rows, although they fill at different rounds."""
    cfg = tmp_path / "two.yaml"
    cfg.write_text(TWO_RANKS.format(out=tmp_path / "calls", strategy=strategy))
    args = ["fit", "--config", "configs/tiny.yaml", "--config", str(cfg), "--config", "configs/dynamic_sampling.yaml",
            "--trainer.logger.init_args.save_dir", str(tmp_path / "logs")]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "tests"), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "lldslight.cli", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    uneven = 0
    for step in range(3):
        r0, r1 = (json.loads((tmp_path / "calls" / f"step{step}_rank{r}.json").read_text()) for r in (0, 1))
        assert len(r0["calls"]) == len(r1["calls"]) and r0["rows"] == r1["rows"] > 0

        def first_full(rec) -> int:  # the round after which this rank alone would have stopped
            kept: list[int] = []
            for i, call in enumerate(rec["calls"]):
                kept += [g for g, r in _groups(call["reward"], call["group_id"]).items() if max(r) > min(r) and g not in kept]
                if len(kept) >= 2:
                    return i
            return len(rec["calls"])

        uneven += first_full(r0) != first_full(r1)
        for rec in (r0, r1):
            assert all(max(r) > min(r) for r in _groups(rec["reward"], rec["group_id"]).values())
    assert uneven, "the ranks always filled at the same round: agreement was never exercised"
