"""CollapseAlarm on a real tiny run: it logs its keys every step from what GRPOModule and LLDMonitor
logged that step, and replay_alarm on the run's metrics.csv (an independent path: the logged CSV,
not the callback's memory) gives back exactly what it logged; its state resumes; bad wiring is a
clear error."""
from __future__ import annotations

import math

import numpy as np
import pytest

from lld_run import AlternatingReward
from lldslight.science.alarm import SIGNALS, AlarmConfig, read_metrics_csv, replay_alarm
from lldslight.errors import ConfigError
from lldslight.update import UpdateConfig
from lldslight.update.optim import OptimConfig

# Tiny-run scale: a 3-step baseline, then statistics sensitive enough (k = 0, h = 0.3) that the
# 9 steps of a random model cross and fire, so the comparison with the replay is not vacuous.
RULE = dict(signals=["tool_call_rate", "answered_rate", "gate_open", "delta_negative_share", "first_vs_later_logp"],
            baseline_start=0, baseline_end=3, baseline_min=2, k=0.0, h=0.3, votes=1, consecutive=1, far=2.0,
            share_window=4, share_min=1)
STEPS = 9


@pytest.fixture(scope="module")
def alarm_run(tmp_path_factory, synth_kb, bm25):
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    from conftest import tiny_policy_config
    from lldslight.callbacks import CollapseAlarm, LLDMonitor, SearchRollout
    from lldslight.data.datamodule import SearchQADataModule
    from lldslight.module import GRPOModule
    from lldslight.rollout import RolloutConfig

    pl.seed_everything(0)
    root = tmp_path_factory.mktemp("alarmrun")
    rollout = RolloutConfig(group_size=3, max_turns=1, max_new_tokens=6, max_obs_tokens=16, max_response_tokens=40, topk=1)
    alarm = CollapseAlarm(rule=AlarmConfig(**RULE))
    fired = []
    alarm.add_listener(lambda event, trainer, module: fired.append((event, trainer.global_step)))
    module = GRPOModule(policy=tiny_policy_config(), update=UpdateConfig(updates_per_rollout=2, micro_batch_size=6, kl_coef=0.0), optim=OptimConfig(lr=1e-2))
    data = SearchQADataModule(train_files=[str(synth_kb["train"])], batch_size=2)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=STEPS, logger=CSVLogger(str(root), name="tiny"),
        callbacks=[SearchRollout(retriever=bm25, reward=AlternatingReward(), rollout=rollout), LLDMonitor(plot=False), alarm],
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        num_sanity_val_steps=0, log_every_n_steps=1, limit_val_batches=0,
    )
    trainer.fit(module, datamodule=data)
    return {"run_dir": trainer.log_dir, "alarm": alarm, "fired": fired}


def test_the_callback_logs_its_keys_every_step(alarm_run):
    cols = read_metrics_csv(alarm_run["run_dir"])
    train = [i for i, r in enumerate(cols["train/reward"]) if math.isfinite(r)]
    assert len(train) == STEPS
    for name in RULE["signals"]:
        assert all(math.isfinite(cols[f"alarm/{name}_crossed"][i]) for i in train), name
        # NaN while the baseline is collected (steps 0-1), a statistic from step 2 on.
        assert math.isnan(cols[f"alarm/{name}"][train[0]]) and all(math.isfinite(cols[f"alarm/{name}"][i]) for i in train[2:])
    assert all(math.isfinite(cols[k][i]) for k in ("alarm/votes", "alarm/fired") for i in train)


def test_replay_of_the_logged_csv_equals_what_the_callback_logged(alarm_run):
    cols = read_metrics_csv(alarm_run["run_dir"])
    out = replay_alarm(alarm_run["run_dir"], AlarmConfig(**RULE))
    train = [i for i, r in enumerate(cols["train/reward"]) if math.isfinite(r)]
    assert out["step"] == [cols["step"][i] for i in train]
    keys = [k for k in out if k.startswith("alarm/") and not k.endswith(("_value", "_z")) and k != "alarm/onset"]
    assert sorted(keys) == sorted(k for k in cols if k.startswith("alarm/"))
    for key in keys:
        logged = [cols[key][i] for i in train]
        # The logger stores float32 and the callback fed the rule float32-rounded inputs, as the CSV
        # holds them: equal once the replay's output is rounded the same way; NaN with NaN.
        for a, b in zip(logged, out[key]):
            assert (math.isnan(a) and math.isnan(b)) or a == float(np.float32(b)), (key, logged, out[key])
    # Not vacuous: the statistics moved and the alarm fired, on the steps the callback reported.
    assert any(v > 0 for k in keys if k.endswith(tuple(RULE["signals"])) for v in out[k] if math.isfinite(v))
    fired_steps = [s for s, f in zip(out["step"], out["alarm/fired"]) if f]
    assert fired_steps and fired_steps == [float(s) for s in alarm_run["alarm"].fired_steps]
    assert alarm_run["alarm"].fired_at == int(fired_steps[0])
    # Listeners heard every firing, at the end of the step that fired.
    assert [(e.step, gs) for e, gs in alarm_run["fired"]] == [(int(s), int(s) + 1) for s in fired_steps]
    onsets = [o for o in out["alarm/onset"] if math.isfinite(o)]
    assert onsets == [float(e.onset) for e in alarm_run["alarm"].events]


def test_state_round_trip_keeps_the_history(alarm_run):
    from lldslight.callbacks import CollapseAlarm

    alarm = alarm_run["alarm"]
    again = CollapseAlarm(rule=AlarmConfig(**RULE))
    again.load_state_dict(alarm.state_dict())
    assert again.fired_steps == alarm.fired_steps and again.rule.state_dict() == alarm.rule.state_dict()


def test_the_alarm_must_come_after_the_monitor():
    from lldslight.callbacks import CollapseAlarm, LLDMonitor

    alarm, monitor = CollapseAlarm(), LLDMonitor()
    trainer = type("T", (), {"callbacks": [alarm, monitor]})()
    with pytest.raises(ConfigError, match="after LLDMonitor"):
        alarm.setup(trainer, None, "fit")
    trainer.callbacks = [CollapseAlarm()]
    with pytest.raises(ConfigError, match="LLDMonitor"):
        trainer.callbacks[0].setup(trainer, None, "fit")
    only_module = CollapseAlarm(rule=AlarmConfig(signals=["answered_rate", "reward_vs_peak"]))
    trainer.callbacks = [only_module]
    only_module.setup(trainer, None, "fit")  # signals GRPOModule logs need no monitor
    assert all(SIGNALS[s].source == "GRPOModule" for s in only_module.config.signals)
    no_gate = LLDMonitor(measure_gate=False)
    trainer.callbacks = [no_gate, CollapseAlarm()]
    with pytest.raises(ConfigError, match="measure_gate"):
        trainer.callbacks[1].setup(trainer, None, "fit")
