"""SearchRollout: samples search-augmented trajectories before every training and eval step and
hands them to the module (``GRPOModule.receive_rollout``); SearchRolloutOptions: sets its options
from a config composed after the one that defines it."""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Optional

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn
from tqdm.auto import tqdm

from lldslight.rollout import evaluation
from lldslight.run import stopping
from lldslight.rollout.bounds import check_lengths, check_prompts, check_rows, device_memory, policy_shape
from lldslight.policy.distributed import reduce_over_ranks
from lldslight.rollout.dynamic_sampling import DynamicSamplingConfig, sample_mixed_groups
from lldslight.errors import ConfigError, require
from lldslight.run.metric_rules import reduction
from lldslight.policy.files import load_tokenizer, resolve_model_dir
from lldslight.retrieval.base import check_retriever
from lldslight.retrieval.base import Retriever
from lldslight.rewards import ExactMatchReward, RewardCaller
from lldslight.rollout import BackendFactory, GenerationBackend, RolloutConfig, RolloutEngine, SamplingSettings, WeightSync, eos_ids
from lldslight.rollout.settings import check, describe


class SearchRollout(pl.Callback):
    """Runs the Search-R1 protocol with the current policy and hands the module a Trajectory.

    Training batches get ``rollout.group_size`` sampled rollouts per prompt; validation and test
    batches get one greedy rollout per prompt with ``eval_max_turns`` search rounds (4 in the paper).

    Args:
        retriever: the search engine (BM25, dense, HTTP, or your own ``search(queries, k)``).
        reward: scores a response against the gold answers; None = exact match (docs/algorithm.md §1). Give
            the ``class_path`` of your own callable class (or the import path of a function) to plug
            in another: ``(response, golden_answers)`` and, by keyword, any of ``question``,
            ``data_source``, ``turns`` (lldslight/rewards.py), type hints optional; it must return a
            finite number.
        rollout: sampling settings for training.
        eval_max_turns: search rounds in evaluation.
        eval_max_new_tokens: per-turn budget in evaluation (None = the training one).
        eval_before_fit: evaluate the val split greedily before the first step (the "before" EM;
            skipped when a run resumes from a checkpoint, whose weights are already trained).
        eval_after_fit: evaluate the val split again when training ends (the "after" EM).
        dynamic_sampling: ``{enabled: true, max_rounds: N}`` keeps only groups whose rewards differ
            and samples further prompts (the datamodule's ``refill_prompts``) until the batch is full
            of them, at most N extra rounds per step (DAPO, arXiv 2503.14476;
            lldslight/rollout/dynamic_sampling.py). Off by default and in the paper recipes. From a config
            composed on top of the one that defines this callback, append ``SearchRolloutOptions``
            (configs/dynamic_sampling.yaml).
        backend: the generation backend, by ``class_path`` (lldslight/rollout/backend.py): a class
            taking ``(tokenizer, retriever, reward_fn, config)`` first, its other arguments as
            ``init_args``. ``lldslight.rollout.RolloutEngine`` (default) batches every rollout over
            one cache; ``lldslight.rollout.HFGenerate`` runs transformers' ``generate`` one rollout
            and turn at a time (the reference, and the fallback for models the engine cannot serve).
            docs/generation_backends.md.
        sync_tolerance: after every training step, check that the backend samples from the updated
            weights (lldslight/rollout/sync.py): a RuntimeError when the policy's log-prob of a fixed
            probe moved more than this (nats) while the backend's did not move; null turns it off.
    """

    def __init__(
        self,
        retriever: Retriever,
        # Callable, not the RewardFn protocol: jsonargparse's protocol check wants the protocol's
        # exact parameters and type hints, so the documented keyword form and an unannotated reward
        # were refused ("does not implement protocol"); RewardCaller checks the signature instead.
        reward: Optional[Callable[..., float]] = None,
        rollout: RolloutConfig = RolloutConfig(),
        eval_max_turns: int = 4,
        eval_max_new_tokens: Optional[int] = None,
        eval_before_fit: bool = False,
        eval_after_fit: bool = False,
        dynamic_sampling: DynamicSamplingConfig = DynamicSamplingConfig(),
        backend: BackendFactory = RolloutEngine,
        sync_tolerance: Optional[float] = 1e-4,
    ) -> None:
        require(eval_max_turns >= 0, "SearchRollout.eval_max_turns", ">= 0", eval_max_turns)
        require(eval_max_new_tokens is None or eval_max_new_tokens >= 1, "SearchRollout.eval_max_new_tokens", ">= 1 or null", eval_max_new_tokens)
        self.retriever = retriever
        self.reward = reward if reward is not None else ExactMatchReward()
        RewardCaller(self.reward)  # its signature, now: before the policy loads, in one line
        self.config = rollout
        self.eval_config = dataclasses.replace(
            rollout,
            group_size=1,
            greedy=True,
            max_turns=eval_max_turns,
            max_new_tokens=eval_max_new_tokens or rollout.max_new_tokens,
        )
        self.eval_before_fit = eval_before_fit
        self.eval_after_fit = eval_after_fit
        self.dynamic_sampling = dynamic_sampling
        require(sync_tolerance is None or sync_tolerance > 0, "SearchRollout.sync_tolerance", "> 0 (nats) or null (off)", sync_tolerance)
        self.backend = backend
        self.sync = WeightSync(sync_tolerance) if sync_tolerance is not None else None
        self._warned_short = False
        self._train_engine: Optional[GenerationBackend] = None
        self._eval_engine: Optional[GenerationBackend] = None

    def _engines(self, pl_module) -> tuple[GenerationBackend, GenerationBackend]:
        if self._train_engine is None:
            self._train_engine = self._build(pl_module, self.config)
            self._eval_engine = self._build(pl_module, self.eval_config)
        return self._train_engine, self._eval_engine

    def _build(self, pl_module, config: RolloutConfig) -> GenerationBackend:
        backend = self.backend(pl_module.tokenizer, self.retriever, self.reward, config)
        if not isinstance(backend, GenerationBackend):
            raise ConfigError(f"SearchRollout.backend: {type(backend).__name__} is not a generation backend (it needs "
                              "generate(model, examples, group_size, greedy) -> Trajectory; lldslight/rollout/backend.py)")
        return backend

    def use_backend(self, backend: BackendFactory) -> None:
        """Sample with ``backend`` from now on: the engines are built from it when first used."""
        self.backend = backend
        self._train_engine = self._eval_engine = None

    def train_engine(self, pl_module) -> GenerationBackend:
        """The engine training rollouts are sampled with (other callbacks, e.g. LLDProbe, sample with it too)."""
        return self._engines(pl_module)[0]

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            require(self.config.group_size >= 2, "rollout.group_size", ">= 2 for training", self.config.group_size,
                    "GRPO's advantage is a reward minus its group's mean, so a group of one has advantage 0")
            updates = pl_module.update_config.updates_per_rollout
            batch = getattr(trainer.datamodule, "batch_size", None)
            if isinstance(batch, int):
                # Known only here (data.batch_size x rollout.group_size): more mini-batches than rows
                # would leave some empty, and those updates would silently not happen.
                rows = batch * self.config.group_size
                require(updates <= rows, "model.update.updates_per_rollout",
                        f"<= the rollout rows per step and rank (data.batch_size {batch} x rollout.group_size "
                        f"{self.config.group_size} = {rows})", updates, "each update trains on its own mini-batch of rows")
        # Before the policy loads (GRPOModule.configure_model): sizes against the model and the
        # machine, then open the index, probe the server.
        self._check_sizes(trainer, pl_module, stage)
        check_retriever(self.retriever, self.config.topk)
        temp = pl_module.logprob_temperature
        if stage == "fit" and abs(temp - self.config.temperature) > 1e-9:
            pl.utilities.rank_zero_warn(
                f"rollout.temperature={self.config.temperature} but model.logprob_temperature={temp}: "
                "the first update is then not on-policy (ratio != 1); set them equal"
            )

    def _check_sizes(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        policy_cfg = getattr(pl_module, "policy_config", None)
        shape = policy_shape(policy_cfg) if policy_cfg is not None else None
        if shape is None:
            return
        check_lengths(self.config, shape)
        datamodule = trainer.datamodule
        batch = getattr(datamodule, "batch_size", None)
        if stage == "fit" and isinstance(batch, int):
            memory, words = device_memory(trainer.strategy.root_device)
            group = self.config.group_size
            check_rows(batch * group, batch, group, self.config, shape, memory, words)
        splits = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",)}.get(stage, ())
        examples = [(s, getattr(datamodule, f"{s}_examples", None) or []) for s in splits]
        if any(rows for _, rows in examples):
            tokenizer = load_tokenizer(policy_cfg, resolve_model_dir(policy_cfg, weights=False))
            for split, rows in examples:
                check_prompts(rows, tokenizer, self.config, shape, split)

    def on_fit_start(self, trainer, pl_module) -> None:
        self._check_sampling(trainer, pl_module)
        # Here, not in setup: SearchRolloutOptions may turn the option on in its own setup.
        if not self.dynamic_sampling.enabled:
            return
        datamodule = trainer.datamodule
        if datamodule is None or not hasattr(datamodule, "refill_prompts"):
            raise ConfigError(
                "SearchRollout.dynamic_sampling needs a datamodule with refill_prompts (SearchQADataModule) "
                f"to draw further prompts; got {type(datamodule).__name__}"
            )

    def _check_sampling(self, trainer, pl_module) -> None:
        """Say what the training backend samples with, once, and refuse settings other than the
        config's (lldslight/rollout/settings.py)."""
        engine = self.train_engine(pl_module)
        name = type(engine).__name__
        configured = SamplingSettings.configured(self.config, pl_module.tokenizer, eos_ids(pl_module.tokenizer))
        report = getattr(engine, "sampling_settings", None)
        used = report() if report is not None else configured
        if trainer.is_global_zero:
            line = describe(used, name if report is not None else f"{name}, which does not report its settings: as configured",
                            pl_module.policy)
            print(line, flush=True)
        check(used, configured, name)

    def on_train_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int) -> None:
        engine, _ = self._engines(pl_module)
        unavailable = getattr(self.retriever, "unavailable_count", None)
        short = getattr(self.retriever, "short_circuited_count", None)
        t0 = time.perf_counter()
        step = trainer.global_step + 1
        with stopping.interruptible(f"the rollout of training step {step}"):  # a resume samples it again
            if self.dynamic_sampling.enabled:
                traj, retrieval_s = self._dynamic_batch(trainer, pl_module, engine, batch)
            else:
                traj = engine.generate(pl_module.policy, batch)
                retrieval_s = getattr(engine, "stats", {}).get("retrieval_s", 0.0)
        stopping.update_began(step)
        pl_module.receive_rollout(traj, "train", timings={"rollout_s": time.perf_counter() - t0, "retrieval_s": retrieval_s})
        counters = {}
        if unavailable is not None:  # HttpRetriever(on_unavailable="observe"): queries answered "unavailable"
            counters["retrieval/unavailable"] = float(self.retriever.unavailable_count - unavailable)
        if short is not None:  # of those, answered by the open circuit breaker without a request
            counters["retrieval/short_circuited"] = float(self.retriever.short_circuited_count - short)
            counters["retrieval/breaker_open"] = float(self.retriever.breaker_open)
        for key, value in counters.items():  # over ranks by metric_rules: counts add up, the breaker flag is a max
            pl_module.log(key, value, on_step=True, on_epoch=False, reduce_fx=reduction(key), batch_size=len(batch),
                          sync_dist=trainer.world_size > 1)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.sync is None:
            return
        # The step's updates are done: the backend must sample from the weights they left.
        metrics = self.sync.after_step(self.train_engine(pl_module).probe_logprob, pl_module.policy, trainer.global_step - 1)
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1, sync_dist=False)

    def _dynamic_batch(self, trainer, pl_module, engine: GenerationBackend, batch: Any):
        """Dynamic sampling (lldslight/rollout/dynamic_sampling.py): the trajectory and the
        retrieval time of all its rounds; logs rollout/{rounds,kept_groups,dropped_groups,filled}."""
        datamodule = trainer.datamodule
        retrieval = [0.0]

        def generate(prompts):
            traj = engine.generate(pl_module.policy, prompts)
            retrieval[0] += getattr(engine, "stats", {}).get("retrieval_s", 0.0)
            return traj

        cfg = self.dynamic_sampling
        result = sample_mixed_groups(generate, datamodule.refill_prompts, list(batch), cfg.max_rounds, pl_module.device)
        if result.filled < 1.0 and not self._warned_short:
            self._warned_short = True
            what = (
                f"only {result.kept_groups} of {len(batch)} groups per rank had mixed rewards; training on those"
                if result.filled > 0
                else "some rank found no group with mixed rewards; training on the first round as sampled"
            )
            pl.utilities.rank_zero_warn(
                f"dynamic sampling at step {trainer.global_step}: after {cfg.max_rounds} extra rounds {what}. "
                "Shown once; rollout/filled < 1 marks every such step (raise dynamic_sampling.max_rounds to sample more)."
            )
        # Group counts over ranks by metric_rules (they add up); rounds and filled are the same on every rank.
        counts = {"rollout/kept_groups": float(result.kept_groups), "rollout/dropped_groups": float(result.sampled_groups - result.kept_groups)}
        counts = reduce_over_ranks(counts, {k: reduction(k) for k in counts}, pl_module.device)
        pl_module.log_dict(
            {"rollout/rounds": float(result.rounds), **counts, "rollout/filled": result.filled},
            on_step=True, on_epoch=False, batch_size=len(result.traj), sync_dist=False,  # reduced above
        )
        return result.traj, retrieval[0]

    def _eval_batch(self, pl_module, batch: Any, what: str) -> None:
        _, engine = self._engines(pl_module)
        with stopping.interruptible(what):  # an evaluation holds nothing a checkpoint keeps
            traj = engine.generate(pl_module.policy, batch)
        pl_module.receive_rollout(traj, "eval")

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self._eval_batch(pl_module, batch, "a validation pass")

    def on_test_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self._eval_batch(pl_module, batch, "the test evaluation")

    # -- before/after evaluation outside Lightning's loops (fit has no "validate first" mode) -----

    def evaluate(self, trainer: pl.Trainer, pl_module, stage: str = "val") -> Optional[dict]:
        """Greedy rollouts over the val split, finished like Lightning's validation (one path:
        lldslight/rollout/evaluation.py): records gathered over ranks, summary, ``{stage}_stepN`` report.
        Returns evaluation.finish's result, or None without a datamodule."""
        datamodule = trainer.datamodule
        if datamodule is None:
            return None
        _, engine = self._engines(pl_module)
        records = []
        when = stage.rpartition("_")[2]
        with stopping.interruptible(f"the evaluation {when} training" if when in ("before", "after") else "an evaluation"):
            bar = tqdm(datamodule.val_dataloader(), desc="eval rollouts", disable=not trainer.is_global_zero, leave=False)
            for batch in bar:
                records.extend(evaluation.trajectory_records(engine.generate(pl_module.policy, batch)))
                bar.set_postfix(em=f"{sum(r['em'] for r in records) / len(records):.3f}")
        return evaluation.finish(records, stage, trainer)

    def on_train_start(self, trainer, pl_module) -> None:
        if self.sync is not None:
            score = getattr(self.train_engine(pl_module), "probe_logprob", None)
            if score is None:
                rank_zero_warn(f"SearchRollout.backend {type(self.train_engine(pl_module)).__name__} has no probe_logprob: "
                               "whether it samples from the updated weights after each step is not checked "
                               "(lldslight/rollout/sync.py, docs/generation_backends.md)")
                self.sync = None
            else:
                self.sync.start(score, pl_module.policy, pl_module.tokenizer)
        if not self.eval_before_fit:
            return
        if trainer.global_step > 0:
            # A resumed run: its weights are trained, so this would not be a "before" number.
            if trainer.is_global_zero:
                print(f"[lldslight] eval_before_fit skipped: resuming at step {trainer.global_step} "
                      "(the before-training evaluation is in the first run's logs)", flush=True)
            return
        self._record(trainer, pl_module, "before")

    def on_train_end(self, trainer, pl_module) -> None:
        stopping.update_ended()
        if self.eval_after_fit:
            self._record(trainer, pl_module, "after")

    def _record(self, trainer, pl_module, when: str) -> None:
        result = self.evaluate(trainer, pl_module, stage=f"val_{when}")
        if result is None:
            return
        summary = result["summary"]
        # RunSummary reads it; the records pair the after-fit answers with the before-fit ones.
        pl_module.eval_history[when] = dict(summary, records=result["records"])
        for logger in trainer.loggers:
            logger.log_metrics(evaluation.flat_metrics(summary, f"val_{when}"), step=trainer.global_step)
        if trainer.is_global_zero:
            o = summary["overall"]
            print(f"[lldslight] dev {when} training: EM {o['em']:.3f}  F1 {o['f1']:.3f}  searches/q {o['searches']:.2f}  answered {o['answered']:.2f}  (n={o['n']})")


class SearchRolloutOptions(pl.Callback):
    """Sets options of the run's SearchRollout from a config composed after the one that defines it:
    a second config cannot edit one entry of ``trainer.callbacks``, but it can append one
    (``configs/dynamic_sampling.yaml`` appends this). Each argument is the SearchRollout argument of
    the same name; None leaves the SearchRollout's own value. Found by class: exactly one
    SearchRollout must be in ``trainer.callbacks``, and dynamic sampling it already turns on with
    other settings is refused rather than silently overridden.

    Args:
        dynamic_sampling: SearchRollout's ``dynamic_sampling``, e.g. ``{enabled: true, max_rounds: 4}``.
        backend: SearchRollout's ``backend`` (``configs/vllm.yaml`` sets ``lldslight.rollout.VLLMGenerate``).
    """

    # backend is not Optional[...]: jsonargparse then refuses a class_path's init_args (a callable
    # returning a class inside a Union); None is accepted as a default all the same.
    def __init__(self, dynamic_sampling: Optional[DynamicSamplingConfig] = None, backend: BackendFactory = None) -> None:
        self.dynamic_sampling = dynamic_sampling
        self.backend = backend

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        rollouts = [cb for cb in trainer.callbacks if isinstance(cb, SearchRollout)]
        if len(rollouts) != 1:
            raise ConfigError(f"{type(self).__name__} needs exactly one SearchRollout in trainer.callbacks, found {len(rollouts)}")
        rollout = rollouts[0]
        if self.dynamic_sampling is not None:
            current = rollout.dynamic_sampling
            if current.enabled and current != self.dynamic_sampling:
                raise ConfigError(
                    f"{type(self).__name__}(dynamic_sampling={self.dynamic_sampling}) conflicts with the SearchRollout's own "
                    f"dynamic_sampling={current}: set it in one place"
                )
            rollout.dynamic_sampling = self.dynamic_sampling
        if self.backend is not None:
            rollout.use_backend(self.backend)
