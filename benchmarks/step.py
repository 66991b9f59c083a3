"""One GRPO step, lldslight vs TRL's GRPOTrainer, on identical single-turn work, at 1 and 2 threads,
in fp32 and in bf16.

    python benchmarks/step.py --json step.json      # THE command: fp32 and bf16, 1 and 2 threads, 3 rounds each
    python benchmarks/step.py --precision bf16 --threads 2 --rounds 5
    python benchmarks/step.py --profile             # where lldslight's step time goes (shares)
    python benchmarks/step.py --shared-prefix on    # lldslight with a group's prompt encoded once only (no unshared run)
    python benchmarks/step.py --workload lab --precision bf16   # the real-model lab's recipe, against TRL and today's lldslight
    python benchmarks/step.py --vllm on             # also lldslight with its rollouts from a vLLM server (.venv-vllm)

Both sides run at the same precision, each at its best setting for it (``--precision``, default
both in turn): fp32 = every weight and all compute in fp32 (lldslight ``policy.precision: fp32``,
TRL ``bf16=False`` with an fp32 model); bf16 = lldslight ``policy.precision: bf16-mixed`` (bf16
base, fp32 adapter and optimiser, bf16 autocast, fp32 log-softmax; docs/precision.md) and TRL
``bf16=True`` with the model loaded in bf16 (``model_init_kwargs.dtype``: TRL generates outside the
Trainer's autocast, so fp32 weights would decode in fp32; peft keeps the adapter fp32).

Both sides: SmolLM2-135M-Instruct (the de-quantised cache dir lldslight makes from the
bundled GGUF; TRL loads it by path), the same prompts, G, max new tokens, sampling settings
(temperature 1, no top-p/top-k), LoRA r=16 on all linear layers, gradient checkpointing, the
"grpo" aggregation (seq-mean-token-mean), one optimiser update per step, the same micro-batch
size, the same reward function. No search: lldslight's RolloutEngine runs with max_turns=0 (the
final generation only), so TRL can do the same work. TRL 1.16 is installed into
benchmarks/.venv-trl on first use (or pass --trl-python / set LLDSLIGHT_TRL_PYTHON).

``--workload lab`` (``both``: the single-turn work, then this) times the real-model lab's recipe
instead (benchmarks/step_lab.py says what each side does and what still differs): LoRA on the top 8
of 30 layers, 16 rollouts with one BM25 search then an answer, 4 updates per rollout batch; the
sides are "lldslight" (as shipped, ``frozen_prefix`` on), "lldslight-today" (``frozen_prefix`` off)
and TRL with ``layers_to_transform``, ``steps_per_generation`` set so that it too takes 4 optimiser
steps on 4 rows each per generation batch, and a Search-R1 ``rollout_func``. The unit timed is one
rollout batch and its updates; ratios: ``step_time_ratio`` (lldslight / TRL), ``today_ratio``
(lldslight / lldslight-today, per phase in ``today_ratios``), ``step_time_ratio_today``
(lldslight-today / TRL), under the report's ``lab`` key. No bounds (their model of the step is
single-turn with LoRA on every layer). ``--lab-rollout KEY=VALUE`` adds a rollout setting to the
shipped run only (a hook for decode options today's lldslight lacks).

``--vllm on`` adds a side, "lldslight-vllm": lldslight as shipped with ``SearchRollout(backend:
VLLMGenerate)``, a vLLM server on loopback that the worker starts from ``--vllm-python``
(.venv-vllm, scripts/setup_vllm.sh) before its warm-up step, the adapter pushed at the start of
each rollout (inside ``generation_s``; ``sync_s`` is that push), the server computing on the same
cores as the trainer. Reported: ``step_time_ratio_vllm`` (against TRL), ``vllm_ratios`` (against
the engine's side: step, generation, generation tokens/s) and ``vllm_sync_s``; with ``--workload lab``
the same beside the lab's shipped run (its searches and passages included).
``--vllm-mode inprocess`` runs ``vllm.LLM`` inside that worker instead (the worker then runs from
``--vllm-python``), and ``--vllm-weights merged`` (in process only) pushes the merged weights
instead of the adapter: the two pushes' costs, compared by ``vllm_sync_s``.

Timing (benchmarks/harness.py): each side runs in its own subprocess (its own peak RSS), one
warm-up step then ``--steps`` measured steps; sides alternate A B A B for ``--rounds`` rounds per
thread count. Around every measured step the worker records the load average and the CPU time of
every other process; a run in which others used more than ``--quiet-threshold`` of a core is
flagged busy and repeated (``--no-repeat`` keeps it). Reported per side: medians over rounds with
[min-max]; the ratios (lldslight / TRL) as ratio of medians with each round's own ratio.

lldslight runs twice per round: "lldslight" checkpoints every decoder layer, as TRL does (the like-
for-like figure, ``step_time_ratio``), and "lldslight-auto" runs with ``gradient_checkpointing:
auto`` (layers keep their activations while they fit in ``--activation-budget-mb``;
lldslight/policy/activation_checkpointing.py), which trades that much memory for less recompute
(``step_time_ratio_auto``). ``--lldslight-checkpointing on`` runs the first only. Both encode a
group's shared prompt once in the update (``model.shared_prefix``, the default; lldslight/update/shared_prefix.py);
with ``--shared-prefix both`` (the default) a third run, "lldslight-unshared", checkpoints every layer
and encodes every row in full (``shared_prefix: false``): ``step_time_ratio_unshared`` against TRL,
and ``shared_prefix_ratio`` (lldslight / lldslight-unshared, step and phases) says what the sharing
saves. ``--shared-prefix off`` runs the first two with it off. lldslight's workers run with the malloc
tunables the ``lldslight`` command sets for itself (lldslight/run/hostmem.py); TRL's with glibc's
defaults, or with the same tunables under ``--malloc same`` (a like-for-like allocator check).

Also per side: memory (peak RSS of the process; and, from the idle process after the warm-up
step, with weights loaded, the peak above it during generation and during the update, from the
kernel's VmHWM reset per phase), and the bounds (benchmarks/bounds.py, measured in the same
invocation, once per thread count for both precisions): a decode step against memory bandwidth and
the matmul peak of its precision (the physical limit) and against its matmuls alone at the actual
shapes (the BLAS), and the update's FLOPs against the peak and against the training-shape rate, as
fractions. The closing note says how far each ratio is from 0.5x and each decode step from the
physical limit.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

if __package__:  # benchmarks.step: imported (tests), or run as python -m benchmarks.step
    from . import bounds, harness
else:  # python benchmarks/step.py: the script's own folder is on sys.path
    import bounds
    import harness

TRL_VENV = HERE / ".venv-trl"
TRL_VERSION = "1.16.0"
TORCH_WHEEL_GLOB = "torch-2.13.0+cpu-*.whl"
SIDES = ("lldslight", "lldslight-auto", "lldslight-unshared", "lldslight-today", "lldslight-vllm", "trl")
LLDSLIGHT_SIDES = ("lldslight", "lldslight-auto", "lldslight-unshared", "lldslight-today", "lldslight-vllm")
# each lldslight run's suffix on its ratio keys (step_time_ratio<suffix>) and its label
RATIO_SUFFIX = {"lldslight": "", "lldslight-auto": "_auto", "lldslight-unshared": "_unshared", "lldslight-today": "_today",
                "lldslight-vllm": "_vllm"}
RATIO_LABEL = {"lldslight": "ratio", "lldslight-auto": "ratio (auto)", "lldslight-unshared": "ratio (unshared)",
               "lldslight-today": "ratio (today)", "lldslight-vllm": "ratio (vLLM)"}
VLLM_KEYS = ("step_s", "generation_s", "gen_tokens_per_s")  # rollouts from vLLM / from the engine, the rest the same
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"  # scripts/setup_vllm.sh
WORKLOADS = ("single", "lab", "both")
SHARED_PREFIX_KEYS = ("step_s", "logprob_s", "update_s", "update_peak_above_idle_mb")  # what sharing changes
TODAY_KEYS = ("step_s", "generation_s", "logprob_s", "update_s")  # lab: the shipped lldslight / today's, per phase
PRECISIONS = ("fp32", "bf16")
LLDSLIGHT_PRECISION = {"fp32": "fp32", "bf16": "bf16-mixed"}  # policy.precision per benchmark precision
TARGET_RATIO = 0.5  # the speed target: step <= 0.5x TRL's
TARGET_DECODE_FRACTION = 0.4  # the speed target: a bf16 decode step >= 40% of the physical limit

# Open-ended requests so that most completions run to the token budget on both sides: the work
# per step then depends on the config, not on when a sample happens to emit EOS.
PROMPTS = [
    "Write a long, detailed story about a lighthouse keeper who finds a message in a bottle.",
    "Explain in detail how a steam engine works, step by step, for a curious teenager.",
    "Describe a day in the life of a medieval blacksmith, with as much detail as you can.",
    "Write a long letter from a sailor to his family describing a storm at sea.",
    "Explain the water cycle in great detail, covering evaporation, clouds, rain and rivers.",
    "Tell a long fairy tale about a fox, a crow and a clever little girl.",
    "Describe how bread is made, from the wheat field to the bakery, in detail.",
    "Write a detailed travel diary of a week spent walking across the mountains.",
]


def reward(text: str) -> float:
    """Cheap, deterministic, and varied across a group (so advantages and gradients are non-zero)."""
    words = text.split()
    return len(set(words)) / 64.0


def _profiling():
    """benchmarks/profiling.py, imported where it is used (it imports torch)."""
    return importlib.import_module(f"{__package__}.profiling" if __package__ else "profiling")


def _step_lab():
    """benchmarks/step_lab.py: the lab workload's two sides."""
    return importlib.import_module(f"{__package__}.step_lab" if __package__ else "step_lab")


# -- measuring inside a worker ------------------------------------------------------------------


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


class PhaseMemory:
    """Peak RSS above the idle process, per phase of a step: ``begin()`` at the step's start (the
    process at rest, weights loaded), ``phase(name)`` at each phase's end. Linux resets the
    high-water mark VmHWM when "5" is written to /proc/self/clear_refs, so each phase's peak is
    exact (no polling); elsewhere the figures are NaN. The reset also resets getrusage's
    ru_maxrss, so the process's peak is kept here (``peak_mb``) across resets."""

    def __init__(self) -> None:
        self.idle_mb = float("nan")
        self.peaks: dict[str, float] = {}
        self.peak_mb = 0.0

    def _reset(self) -> bool:
        self.peak_mb = max(self.peak_mb, _status_mb("VmHWM"))
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError:
            return False

    def begin(self) -> None:
        self.peaks = {}
        self.idle_mb = _status_mb("VmRSS") if self._reset() else float("nan")

    def phase(self, name: str) -> None:
        self.peaks[name] = _status_mb("VmHWM") - self.idle_mb
        self._reset()

    def record(self) -> dict[str, float]:
        return {"idle_rss_mb": self.idle_mb, **{f"{k}_peak_above_idle_mb": v for k, v in self.peaks.items()}}


class StepClock:
    """Everything one measured step records: wall time, load around it, memory per phase, and
    the work it did (rows, tokens, lengths) for the bounds."""

    def __init__(self, spec: dict) -> None:
        self.spec = spec
        self.records: list[dict] = []
        self.memory = PhaseMemory()
        self.meter: harness.LoadMeter | None = None
        self.profiler = None
        self.seen = 0

    @property
    def measuring(self) -> bool:
        return self.seen > self.spec["warmup"]

    def begin(self, model) -> None:
        self.seen += 1
        if not self.measuring:
            return
        if self.spec.get("profile") and self.profiler is None:
            self.profiler = _profiling().StepProfiler(model)
            self.profiler.start()
        self.memory.begin()
        self.meter = harness.LoadMeter().start()
        self.t0 = time.perf_counter()

    def generation_done(self) -> None:
        if self.measuring:
            self.memory.phase("generation")

    def end(self, times: dict, work: dict) -> None:
        if not self.measuring:
            return
        total = time.perf_counter() - self.t0
        load = self.meter.stop()  # type: ignore[union-attr]
        self.memory.phase("update")
        if self.profiler is not None and self.profiler.active:
            self.profiler.stop()
        self.records.append({
            "step_s": total, **times, **work, **self.memory.record(),
            "gen_tokens_per_s": work["tokens"] / times["generation_s"], "load": load.to_dict(),
        })

    def result(self) -> dict:
        out = {"steps": self.records, "peak_rss_mb": max(self.memory.peak_mb, _status_mb("VmHWM"), _rss_mb())}
        if self.profiler is not None:
            out["profile"] = self.profiler.shares()
        return out


def work_of(prompt_len, completion_len) -> dict:
    """The step's work from per-row prompt and completion lengths (lists of ints)."""
    steps = max(completion_len)
    return {
        "rows": len(completion_len),
        "tokens": sum(completion_len),
        "decode_steps": steps,
        # mean context a decode step attends to: the prompt plus half the completion so far
        "context": statistics.mean(prompt_len) + steps / 2,
        "lengths": [p + c for p, c in zip(prompt_len, completion_len)],
        "loss_tokens": sum(completion_len),
    }


# -- workers -------------------------------------------------------------------------------------


def module_groups(spec: dict) -> dict:
    """lldslight's side as GRPOModule's argument groups (policy, update, optim): one learning-rate
    step with micro-batches of ``micro_batch`` rows, no entropy term, the KL pass when beta > 0."""
    from lldslight.update.optim import OptimConfig
    from lldslight.policy import LoRAConfig, PolicyConfig
    from lldslight.update import UpdateConfig

    return dict(
        policy=PolicyConfig(
            model=spec["model_dir"],
            precision=LLDSLIGHT_PRECISION[spec.get("precision", "fp32")],
            lora=LoRAConfig(r=spec["lora_r"], alpha=2 * spec["lora_r"]),
            gradient_checkpointing=spec.get("checkpointing", True),
            activation_budget_mb=spec.get("activation_budget_mb", 256.0),
        ),
        update=UpdateConfig(
            updates_per_rollout=1,
            micro_batch_size=spec["micro_batch"],
            micro_batch_tokens=spec.get("micro_batch_tokens") or None,
            kl_coef=spec["beta"],
            aggregation="seq-mean-token-mean",
            grad_clip=1.0,
            shared_prefix=spec.get("shared_prefix", True),
        ),
        optim=OptimConfig(lr=1e-5),
        **({"logprob_chunk_size": spec["logprob_chunk_size"]} if spec.get("logprob_chunk_size") else {}),
    )


def single_parts(spec: dict):
    """(module, SearchRollout, examples) for the single-turn workload: GRPOModule from
    ``module_groups``, no search (max_turns 0), the open-ended prompts, the cheap reward."""
    from lldslight.callbacks import SearchRollout
    from lldslight.data.example import QAExample
    from lldslight.module import GRPOModule
    from lldslight.rollout import RolloutConfig

    class NoSearch:
        def search(self, queries, k):
            return [[] for _ in queries]

    examples = [
        QAExample(id=str(i), question=q, golden_answers=["-"], data_source="bench", messages=[{"role": "user", "content": q}], group_id=i)
        for i, q in enumerate(spec["prompts"])
    ]
    rollout = RolloutConfig(
        group_size=spec["group_size"],
        max_turns=0,
        max_new_tokens=spec["max_new_tokens"],
        max_response_tokens=spec["max_new_tokens"],
        temperature=1.0,
    )
    backend = {}
    if spec.get("side") == "lldslight-vllm":
        backend = dict(backend=_step_lab().vllm_backend(spec), sync_tolerance=None)  # vllm_backend says why
    callback = SearchRollout(retriever=NoSearch(), reward=lambda text, gold: reward(text), rollout=rollout, **backend)
    return GRPOModule(**module_groups(spec)), callback, examples


def worker_lldslight(spec: dict) -> dict:
    import torch

    torch.set_num_threads(spec["threads"])
    # a vLLM server this worker starts computes on the same cores as the trainer (it waits while the trainer works)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{spec['threads'] - 1}")
    import lightning.pytorch as pl

    if spec.get("workload") == "lab":
        os.chdir(ROOT)  # the recipe names its corpus, data and warm start from the root
        overrides = spec.get("lab_rollout", {}) if spec["side"] == "lldslight" else {}
        module, rollout, examples = _step_lab().lldslight_parts(spec, spec["side"], overrides)
    else:
        module, rollout, examples = single_parts(spec)

    class Prompts(torch.utils.data.IterableDataset):
        def __iter__(self):
            while True:
                yield examples

    class Data(pl.LightningDataModule):
        def train_dataloader(self):
            return torch.utils.data.DataLoader(Prompts(), batch_size=None)

    clock = StepClock(spec)
    labels = _Labels(spec)

    class Timer(pl.Callback):
        # First in the callback list: its batch start runs before SearchRollout samples.
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            clock.begin(module.policy)
            mark_stale = getattr(rollout.train_engine(module), "mark_stale", None) if clock.measuring else None
            if mark_stale is not None:
                # vLLM: push the adapter in every timed step, as a run does once its updates move the
                # weights; the backend skips an unchanged push, and the lab's warm-up batch at seed 0
                # left the adapter as pushed (its timed steps recorded sync_s 0).
                mark_stale()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            traj = module.last_rollout
            completion = traj.loss_mask.sum(-1)
            work = work_of(traj.prompt_len.tolist(), completion.tolist())
            stats = getattr(rollout.train_engine(module), "stats", {})
            if "sync_s" in stats:  # vLLM: pushing the adapter to the server, inside generation_s
                work["sync_s"] = stats["sync_s"]
            if spec.get("workload") == "lab":  # what the turns added: searches, passages' tokens, retrieval time
                observed = traj.attention_mask.sum(-1) - traj.prompt_len - completion
                work.update(searches=int(traj.num_searches.sum()), obs_tokens=int(observed.sum()),
                            retrieval_s=module.timings.get("retrieval_s", float("nan")))
            clock.end(
                {"generation_s": module.timings.get("rollout_s", float("nan")),
                 "logprob_s": module.timings.get("logprob_s", float("nan")),
                 "update_s": module.timings.get("update_s", float("nan"))},
                work,
            )

    # The step's phases for the memory figures and the profiler, on this module only: the rollout
    # (SearchRollout's batch start) is over when training_step starts.
    training_step, manual_backward = module.training_step, module.manual_backward

    def timed_training_step(batch, batch_idx):
        clock.generation_done()
        with labels("update"):
            return training_step(batch, batch_idx)

    def labelled_backward(loss, *args, **kwargs):
        with labels("backward"):
            return manual_backward(loss, *args, **kwargs)

    module.training_step, module.manual_backward = timed_training_step, labelled_backward
    if spec.get("profile"):
        for module_name, path, name in LLDSLIGHT_LABELS:
            labels.wrap(*profiled_target(module_name, path), name)

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=spec["warmup"] + spec["steps"],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Timer(), rollout],
    )
    pl.seed_everything(spec["seed"], verbose=False)
    trainer.fit(module, datamodule=Data())
    result = clock.result()
    result["trainable_params"] = sum(p.numel() for p in module.policy.parameters() if p.requires_grad)
    return result


# The phases of lldslight's step that --profile labels, on the code path a training step takes
# (SearchRollout -> RolloutEngine.generate; GRPOModule.training_step -> update.train.train_on_rollout,
# whose first part, update.train.prepare, computes the advantages and pi_old's and the reference's
# log-probs). The worker labels training_step ("update") and manual_backward ("backward") itself.
# As (module, attribute path, label); tests/test_bench_step.py checks every target exists.
LLDSLIGHT_LABELS = (
    ("lldslight.rollout", "RolloutEngine.generate", "rollout"),
    ("lldslight.update.train", "prepare", "log-probs"),
)


def profiled_target(module_name: str, path: str) -> tuple[object, str]:
    """(the object that holds it, its attribute name) for an entry of LLDSLIGHT_LABELS; fails when
    the library no longer has it (a renamed phase must not drop out of the profile silently)."""
    owner: object = importlib.import_module(module_name)
    *parents, attr = path.split(".")
    for part in parents:
        owner = getattr(owner, part)
    if not callable(getattr(owner, attr, None)):
        raise AttributeError(f"benchmarks/step.py profiles {module_name}.{path}, which does not exist: update LLDSLIGHT_LABELS")
    return owner, attr


class _Labels:
    """Profiler labels around the phases, only when profiling (a no-op otherwise)."""

    def __init__(self, spec: dict) -> None:
        self.on = bool(spec.get("profile"))

    def __call__(self, name: str):
        import contextlib

        if not self.on:
            return contextlib.nullcontext()
        return _profiling().label(name)

    def wrap(self, obj, attr: str, name: str) -> None:
        if self.on:
            _profiling().wrap(obj, attr, name)


def trl_batch_kwargs(rows: int, micro_batch: int, updates: int) -> dict:
    """GRPOConfig's batch settings for one rollout batch of ``rows`` rows trained on as lldslight's
    ``updates_per_rollout: updates`` trains: ``updates`` optimiser steps, each on its own mini-batch
    of rows / updates rows in micro-batches of ``micro_batch``, every row once. In TRL's counting a
    generation batch is per_device_train_batch_size x steps_per_generation rows, an optimiser step
    accumulates gradient_accumulation_steps micro-batches, and the batch is reused num_iterations
    times; so steps_per_generation = rows / micro, gradient_accumulation_steps = rows / (updates x
    micro), num_iterations = 1 (num_iterations = updates would train on every row ``updates`` times)."""
    if rows % updates or (rows // updates) % micro_batch:
        raise SystemExit(f"step: {rows} rows in {updates} update(s) of micro-batches of {micro_batch}: "
                         "rows / updates must be a multiple of the micro-batch")
    return {"per_device_train_batch_size": micro_batch, "steps_per_generation": rows // micro_batch,
            "gradient_accumulation_steps": rows // (updates * micro_batch), "num_iterations": 1}


def worker_trl(spec: dict) -> dict:
    import torch

    torch.set_num_threads(spec["threads"])
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    lab = spec.get("workload") == "lab"
    clock = StepClock(spec)
    labels = _Labels(spec)
    phase = {"gen": 0.0, "score": 0.0, "work": None}
    updates = spec.get("updates", 1)  # optimiser steps (TRL's global steps) per rollout batch: the unit timed

    class TimedGRPO(GRPOTrainer):
        def _generate_single_turn(self, *args, **kwargs):
            t0 = time.perf_counter()
            with labels("rollout"):
                out = super()._generate_single_turn(*args, **kwargs)
            phase["gen"] += time.perf_counter() - t0
            return out

        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            with labels("log-probs"):
                out = super()._generate_and_score_completions(inputs)
            phase["score"] += time.perf_counter() - t0
            clock.generation_done()
            loss_mask = out["completion_mask"] * out["tool_mask"] if "tool_mask" in out else out["completion_mask"]
            phase["work"] = work_of(out["prompt_mask"].sum(-1).tolist(), loss_mask.sum(-1).tolist())
            if lab:  # the search loop's own time and work (TimedRollout)
                phase["gen"] += rollout.stats["generation_s"]
                phase["work"].update({k: rollout.stats[k] for k in ("searches", "obs_tokens", "retrieval_s")})
            return out

        def training_step(self, *args, **kwargs):
            with labels("update"):
                return super().training_step(*args, **kwargs)

    class Timer(TrainerCallback):
        # One unit = one rollout batch and its ``updates`` optimiser steps.
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step % updates == 0:
                phase.update(gen=0.0, score=0.0, work=None)
                clock.begin(trainer.model)

        def on_step_end(self, args, state, control, **kw):
            if state.global_step % updates or not clock.measuring:
                return
            total = time.perf_counter() - clock.t0
            clock.end(
                # generate_and_score = generation + reference/old log-probs + rewards/advantages
                {"generation_s": phase["gen"], "logprob_s": phase["score"] - phase["gen"], "update_s": total - phase["score"]},
                phase["work"],
            )

    def trl_reward(completions, **kwargs):
        out = []
        for c in completions:
            text = c[0]["content"] if isinstance(c, list) else c
            out.append(reward(text))
        return out

    bf16 = spec.get("precision", "fp32") == "bf16"
    rows = len(spec["prompts"]) * spec["group_size"]
    if lab:
        lab_mod = _step_lab()
        rollout_cfg = spec["rollout"]
        tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"], padding_side="left")
        rollout = lab_mod.SearchR1Rollout(spec, tokenizer)
        workload = dict(max_completion_length=rollout_cfg["max_response_tokens"], temperature=rollout_cfg["temperature"],
                        top_p=rollout_cfg["top_p"], top_k=rollout_cfg["top_k"], learning_rate=spec["lr"],
                        weight_decay=spec["weight_decay"], epsilon=spec["clip_eps"], max_grad_norm=spec["grad_clip"],
                        lr_scheduler_type="constant")
        extra = dict(rollout_func=rollout, processing_class=tokenizer)
        reward_fn = lab_mod.trl_reward(spec)
        dataset = Dataset.from_list(lab_mod.trl_rows(spec))
        lora = LoraConfig(**lab_mod.trl_lora_kwargs(spec))
    else:
        workload = dict(max_completion_length=spec["max_new_tokens"], temperature=1.0, top_p=1.0, top_k=0, learning_rate=1e-5,
                        max_grad_norm=1.0)
        extra = {}
        reward_fn = trl_reward
        dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": q}] for q in spec["prompts"]]})
        lora = LoraConfig(r=spec["lora_r"], lora_alpha=2 * spec["lora_r"], lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    with tempfile.TemporaryDirectory() as out_dir:
        args = GRPOConfig(
            output_dir=out_dir,
            **trl_batch_kwargs(rows, spec["micro_batch"], updates),
            num_generations=spec["group_size"],
            **workload,
            beta=spec["beta"],
            loss_type="grpo",
            max_steps=updates * (spec["warmup"] + spec["steps"]),
            gradient_checkpointing=True,
            bf16=bf16,
            use_cpu=True,
            logging_steps=10_000,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            seed=spec["seed"],
            dataloader_num_workers=0,
            model_init_kwargs={"dtype": torch.bfloat16 if bf16 else torch.float32, "attn_implementation": "sdpa"},
        )
        trainer = TimedGRPO(model=spec["model_dir"], reward_funcs=reward_fn, args=args, train_dataset=dataset, peft_config=lora,
                            callbacks=[Timer()], **extra)
        if spec.get("profile"):
            backward = trainer.accelerator.backward

            def labelled_backward(*a, **k):
                with labels("backward"):
                    return backward(*a, **k)

            trainer.accelerator.backward = labelled_backward
        trainer.train()
    result = clock.result()
    # What was trained: the adapter's size says both sides adapt the same layers.
    result["trainable_params"] = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    return result


# -- driver ---------------------------------------------------------------------------------------


def ensure_trl_venv(python: str | None) -> str:
    """The TRL side's interpreter: --trl-python, else $LLDSLIGHT_TRL_PYTHON, else
    benchmarks/.venv-trl, created on first use.

    torch goes in first, from the CPU wheel on this machine's disk when there is one: an unpinned
    torch from the index would pull several GB of CUDA libraries.
    """
    python = python or os.environ.get("LLDSLIGHT_TRL_PYTHON")
    if python:
        return python
    exe = TRL_VENV / "bin" / "python"
    # bm25s: the lab workload's TRL side searches with lldslight's BM25 retriever, the same version.
    if exe.exists() and subprocess.run([str(exe), "-c", "import trl, peft, transformers, psutil, bm25s"], capture_output=True).returncode == 0:
        return str(exe)
    from importlib.metadata import version

    import transformers

    print(f"[step] creating {TRL_VENV} (torch 2.13 CPU, trl=={TRL_VERSION}, transformers=={transformers.__version__})", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(TRL_VENV)], check=True)
    wheels = sorted(Path("/opt/wheels").glob(TORCH_WHEEL_GLOB))
    torch_req = str(wheels[-1]) if wheels else "torch==2.13.0"
    pip = [str(exe), "-m", "pip", "install", "-q"]
    extra = [] if wheels else ["--index-url", "https://download.pytorch.org/whl/cpu"]
    subprocess.run(pip + [torch_req] + extra, check=True)
    subprocess.run(pip + [f"trl=={TRL_VERSION}", f"transformers=={transformers.__version__}", "peft", "psutil",
                          f"bm25s=={version('bm25s')}"], check=True)
    return str(exe)


def run_worker(side: str, python: str, spec: dict, timeout: float) -> dict:
    from lldslight.run import hostmem

    spec = dict(spec, side=side, checkpointing="auto" if side == "lldslight-auto" else True,
                shared_prefix=spec.get("shared_prefix", True) and side != "lldslight-unshared")
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
        spec_path = f.name
    out_path = spec_path + ".out"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS=str(spec["threads"]))
    malloc = spec.get("malloc", "lldslight")
    if malloc == "same" or (malloc == "lldslight" and side in LLDSLIGHT_SIDES):
        env = hostmem.malloc_env(env)  # as the lldslight command runs itself
    cmd = [python, str(Path(__file__).resolve()), "--worker", side, "--spec", spec_path, "--out", out_path]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 or not Path(out_path).exists():
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise SystemExit(f"[step] {side} worker failed (exit {proc.returncode})")
    result = json.loads(Path(out_path).read_text())
    result["wall_s"] = time.perf_counter() - t0
    os.unlink(spec_path)
    os.unlink(out_path)
    return result


PER_STEP = ("step_s", "generation_s", "logprob_s", "update_s", "tokens", "gen_tokens_per_s", "decode_steps", "context",
            "loss_tokens", "idle_rss_mb")
PEAKS = ("generation_peak_above_idle_mb", "update_peak_above_idle_mb")
LAB_PER_STEP = ("searches", "obs_tokens", "retrieval_s")  # the lab workload's turns: searches, passages' tokens, retrieval
OPTIONAL_PER_STEP = LAB_PER_STEP + ("sync_s",)  # figures some sides have (sync_s: the vLLM side's adapter push)
KEYS = PER_STEP + LAB_PER_STEP + PEAKS + ("peak_rss_mb", "trainable_params")


def run_figures(result: dict) -> tuple[dict, harness.LoadRecord]:
    """One worker run as one harness attempt: the median of its measured steps per figure (peaks:
    the max), and the load over its measured steps."""
    steps = result["steps"]
    figures = {k: statistics.median(s[k] for s in steps) for k in PER_STEP + OPTIONAL_PER_STEP if k in steps[0]}
    figures.update({k: max(s[k] for s in steps) for k in PEAKS})
    figures.update(peak_rss_mb=result["peak_rss_mb"], rows=steps[0]["rows"], steps=steps, wall_s=result["wall_s"])
    if "trainable_params" in result:
        figures["trainable_params"] = result["trainable_params"]
    return figures, harness.combine([harness.LoadRecord.from_dict(s["load"]) for s in steps])


def table(summary: dict, ratios: dict, sides: list[str]) -> str:
    rows = [
        ("step wall time (s)", "step_s", "{:.2f}"),
        ("  generation (s)", "generation_s", "{:.2f}"),
        ("  log-probs: old/ref (s)", "logprob_s", "{:.2f}"),
        ("  update: fwd+bwd+opt (s)", "update_s", "{:.2f}"),
        ("  of which retrieval (s)", "retrieval_s", "{:.2f}"),
        ("generated tokens / step", "tokens", "{:.0f}"),
        ("searches / step", "searches", "{:.0f}"),
        ("passage tokens / step", "obs_tokens", "{:.0f}"),
        ("generation tokens/s", "gen_tokens_per_s", "{:.1f}"),
        ("peak RSS (MB)", "peak_rss_mb", "{:.0f}"),
        ("idle RSS, weights loaded (MB)", "idle_rss_mb", "{:.0f}"),
        ("generation peak above idle (MB)", "generation_peak_above_idle_mb", "{:.0f}"),
        ("update peak above idle (MB)", "update_peak_above_idle_mb", "{:.0f}"),
    ]
    head = f"| {'median [min-max] over rounds':32} |" + "".join(f" {s:>20} |" for s in sides)
    lines = [head, "|" + "-" * 34 + "|" + "".join("-" * 22 + "|" for _ in sides)]
    for side in ratios:  # one ratio column per lldslight setting, against TRL
        lines[0] += f" {RATIO_LABEL[side]:>20} |"
        lines[1] += "-" * 22 + "|"
    for label, key, fmt in rows:
        if not all(key in summary[s] for s in sides):  # the lab's rows on the lab only
            continue
        line = f"| {label:32} |" + "".join(f" {harness.fmt_spread(summary[s][key], fmt):>20} |" for s in sides)
        for side in ratios:
            r = ratios[side][key]
            line += f" {r['ratio_of_medians']:.2f} [{r['spread']['min']:.2f}-{r['spread']['max']:.2f}]".rjust(21) + " |"
        lines.append(line)
    return "\n".join(lines)


def bounds_table(fractions: dict, sides: list[str]) -> str:
    lines = []
    for s in sides:
        f = fractions[s]
        lines.append(
            f"  {s:9}: decode step {f['decode_step_ms']:.1f} ms vs physical limit {f['decode_bound_ms']:.1f} ms "
            f"(memory {f['decode_memory_bound_ms']:.1f}, FLOPs {f['decode_compute_bound_ms']:.1f}) = "
            f"{f['generation_fraction_of_bound']:.0%}, vs its matmuls alone {f['decode_matmuls_ms']:.1f} ms = "
            f"{f['generation_fraction_of_blas']:.0%}; update {f['update_gflops']:.1f} GFLOP/s: {f['update_fraction_of_ceiling']:.0%} "
            f"of the {f['ceiling_gflops']:.0f} GFLOP/s peak, {f['update_fraction_of_blas']:.0%} of the {f['train_shape_gflops']:.0f} "
            f"GFLOP/s training-shape rate")
    return "\n".join(lines)


def measure_threads(threads: int, args, spec: dict, sides: list[str], pythons: dict, policy: harness.Policy, shape,
                    measured_bounds: dict | None = None, with_bounds: bool = True) -> dict:
    """One precision (``spec["precision"]``) at one thread count. ``measured_bounds``: this thread
    count's bounds when an earlier precision measured them (they cover both precisions).
    ``with_bounds``: the bounds' model of the step is single-turn with LoRA on every layer (the
    lab workload has none)."""
    spec = dict(spec, threads=threads)
    precision = spec.get("precision", "fp32")
    out: dict = {"threads": threads, "precision": precision}
    if with_bounds and not args.no_bounds:
        out["bounds"] = measured_bounds or bounds.measure(threads, shape, rows=len(spec["prompts"]) * spec["group_size"])

    def run(side):
        return run_figures(run_worker(side, pythons[side], spec, args.timeout))

    def describe(side, m):
        return f"step {m['step_s']:.1f} s (gen {m['generation_s']:.1f}, update {m['update_s']:.1f}), peak RSS {m['peak_rss_mb']:.0f} MB;"

    attempts = harness.alternate(sides, run, args.rounds, policy, describe=describe)
    out["quiet"] = harness.quiet_summary(attempts, policy)
    keys = [k for k in KEYS if all(k in a.metrics for a in attempts if a.kept)]  # the lab's keys on the lab only
    out["sides"] = {s: harness.side_summary(attempts, s, keys) for s in sides}
    out["attempts"] = [a.to_dict() for a in attempts]
    if "trl" in sides:
        for side, suffix in RATIO_SUFFIX.items():
            if side in sides:
                out["ratios" + suffix] = {k: harness.ratio_summary(attempts, side, "trl", k) for k in keys}
                out["step_time_ratio" + suffix] = out["ratios" + suffix]["step_s"]["ratio_of_medians"]
    for side, base, name, what in (("lldslight", "lldslight-unshared", "shared_prefix", SHARED_PREFIX_KEYS),
                                   ("lldslight", "lldslight-today", "today", TODAY_KEYS),
                                   ("lldslight-vllm", "lldslight", "vllm", VLLM_KEYS)):
        if side in sides and base in sides:
            # one setting's effect, the rest the same: the shared prefix on / off; the lab's shipped / today's lldslight
            out[name + "_ratios"] = {k: harness.ratio_summary(attempts, side, base, k) for k in what}
            out[name + "_ratio"] = out[name + "_ratios"]["step_s"]["ratio_of_medians"]
    if "lldslight-vllm" in sides:  # the adapter push per step, part of the vLLM side's generation_s
        out["vllm_sync_s"] = statistics.median(a.metrics["sync_s"] for a in harness.kept(attempts, "lldslight-vllm"))
    if "bounds" in out:
        out["fractions"] = {}
        for s in sides:
            med = {k: v["median"] for k, v in out["sides"][s].items()}
            kept_run = min(harness.kept(attempts, s), key=lambda a: abs(a.metrics["step_s"] - med["step_s"]))
            med.update(rows=kept_run.metrics["rows"], lengths=kept_run.metrics["steps"][0]["lengths"])
            # lldslight recomputes no vocabulary projection (logprobs.py); "auto" kept every layer's
            # activations when they fit the budget: its bound is the update without recompute.
            out["fractions"][s] = bounds.step_fractions(out["bounds"], shape, med, lora_r=spec["lora_r"], head_recompute=False,
                                                        checkpointing=s != "lldslight-auto", precision=precision)
        first = harness.kept(attempts, sides[0])[0].metrics["steps"][0]
        out["update_variants_gflop"] = bounds.update_variants(shape, first["lengths"], first["loss_tokens"], spec["lora_r"])
    return out


def title(res: dict, args, spec: dict) -> str:
    """The line above a thread count's table: the workload as both sides ran it."""
    if spec.get("workload") == "lab":
        r, lora = spec["rollout"], spec["lora"]
        layers = lora["layers_to_transform"]
        return (f"GRPO step, the real-model lab's workload ({spec['recipe']}): SmolLM2-135M warm start {res.get('precision', 'fp32')} "
                f"LoRA r={lora['r']} on layers {layers[0]}-{layers[-1]}: {len(spec['prompts'])} prompts x G={spec['group_size']}, "
                f"{r['max_turns']} search + an answer ({r['max_new_tokens']} tokens a turn, BM25 top-{r['topk']}, "
                f"{r['max_response_tokens']} response tokens), {spec['updates']} updates per rollout batch, micro-batch "
                f"{spec['micro_batch']}, gradient checkpointing; {args.rounds} alternating rounds x {args.steps} steps; {res['threads']} thread(s)")
    return (f"GRPO step, single-turn, SmolLM2-135M-Instruct {res.get('precision', 'fp32')} LoRA r={args.lora_r}: {args.prompts} prompts x G={args.group_size}, "
            f"{args.max_new_tokens} new tokens, micro-batch {args.micro_batch}, beta {args.beta}, 1 update/step, gradient checkpointing; "
            f"{args.rounds} alternating rounds x {args.steps} steps; {res['threads']} thread(s)")


def print_threads(res: dict, args, sides: list[str], spec: dict | None = None) -> None:
    spec = spec or {}
    print()
    print(title(res, args, spec))
    ratios = {side: res["ratios" + suffix] for side, suffix in RATIO_SUFFIX.items() if "ratios" + suffix in res}
    print(table(res["sides"], ratios, sides))
    if "fractions" in res:
        b = res["bounds"]
        print(f"bounds at {res['threads']} thread(s): read {bounds_read(b):.1f} GB/s, sgemm {b['sgemm_gflops']['square_2048']:.0f} GFLOP/s "
              f"(2048^2), decode-shape sgemm " + ", ".join(f"{k} {v:.0f}" for k, v in b["sgemm_gflops"].items() if k != "square_2048"))
        if "bf16_gemm_gflops" in b:
            print(f"  bf16 ({'native' if b['cpu_bf16']['native'] else 'NOT native'}, {b['cpu_bf16']['evidence']}): "
                  f"{b['bf16_gemm_gflops']['square_2048']:.0f} GFLOP/s (2048^2), " +
                  ", ".join(f"{k} {v:.0f}" for k, v in b["bf16_gemm_gflops"].items() if k != "square_2048"))
        print(bounds_table(res["fractions"], sides))
        print("  update GFLOP for this work: " + ", ".join(f"{k} {v:.1f}" for k, v in res["update_variants_gflop"].items()))
    shared = "shared prefix off" if args.shared_prefix == "off" else "shared prefix on"
    lab = spec.get("workload") == "lab"
    for suffix, what in (("", "as shipped, frozen prefix on" if lab else f"every layer checkpointed, as TRL, {shared}"),
                         ("_auto", f"checkpointing auto, {args.activation_budget_mb:.0f} MiB, {shared}"),
                         ("_unshared", "every layer checkpointed, shared prefix off"),
                         ("_today", "today's, frozen prefix off"),
                         ("_vllm", "rollouts from vLLM, " + ("as shipped, frozen prefix on" if lab else f"every layer checkpointed, {shared}"))):
        if "step_time_ratio" + suffix in res:
            r = res["ratios" + suffix]["step_s"]
            print(f"step_time_ratio{suffix} (lldslight, {what} / TRL) at {res['threads']} thread(s): {r['ratio_of_medians']:.3f} "
                  f"(per round {', '.join(f'{x:.2f}' for x in r['per_round'])})")
    if "shared_prefix_ratios" in res:
        print("shared prefix on / off (lldslight / lldslight-unshared): " + ", ".join(
            f"{k} {r['ratio_of_medians']:.3f} (per round {', '.join(f'{x:.2f}' for x in r['per_round'])})"
            for k, r in res["shared_prefix_ratios"].items()))
    if "vllm_ratios" in res:
        print("rollouts from vLLM / from the engine (lldslight-vllm / lldslight): " + ", ".join(
            f"{k} {r['ratio_of_medians']:.3f} (per round {', '.join(f'{x:.2f}' for x in r['per_round'])})"
            for k, r in res["vllm_ratios"].items()) + f"; adapter push {res['vllm_sync_s']:.3f} s per step")
    if "today_ratios" in res:
        print("as shipped / today's (lldslight / lldslight-today): " + ", ".join(
            f"{k} {r['ratio_of_medians']:.3f} (per round {', '.join(f'{x:.2f}' for x in r['per_round'])})"
            for k, r in res["today_ratios"].items()))
    print(harness.quiet_line(res["quiet"]))


def bounds_read(b: dict) -> float:
    return bounds.read_gbs(b)


def profile(args, spec: dict, sides: list[str], pythons: dict) -> None:
    print_shares = _profiling().print_shares

    threads = [int(t) for t in args.threads.split(",")]
    spec = dict(spec, threads=threads[0], steps=1, profile=True)
    for side in sides:
        res = run_worker(side, pythons[side], spec, args.timeout)
        step = res["steps"][0]
        load = step["load"]
        print_shares(res["profile"], f"[profile] {side}, {threads[0]} thread(s): one step of {step['step_s']:.1f} s under the profiler "
                     f"(profiled total {res['profile']['total_s']:.1f} s); load average {load['loadavg_start'][0]:.2f}, "
                     f"other processes {load['other_cores']:.2f} cores")
        if args.json:
            Path(args.json).write_text(json.dumps({"config": recorded(spec), "profile": {side: res["profile"]}, "step": step}, indent=1))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=2, help="distinct prompts per step (<= %d)" % len(PROMPTS))
    p.add_argument("--group-size", type=int, default=4, help="G, completions per prompt")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=4, help="rows per forward/backward (TRL: per_device_train_batch_size)")
    p.add_argument("--micro-batch-tokens", type=int, default=None, help="lldslight only: pack micro-batches by token budget")
    p.add_argument("--logprob-chunk-size", type=int, default=None, help="lldslight only: positions per vocabulary chunk (default: the library's)")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lldslight-checkpointing", choices=["on", "on,auto"], default="on,auto",
                   help="lldslight's settings to run: every layer checkpointed (as TRL), and gradient_checkpointing: auto")
    p.add_argument("--activation-budget-mb", type=float, default=256.0, help="lldslight-auto: policy.activation_budget_mb")
    p.add_argument("--shared-prefix", choices=["on", "off", "both"], default="both",
                   help="lldslight's model.shared_prefix: on, off, or on plus a run with it off (lldslight-unshared)")
    p.add_argument("--malloc", choices=["lldslight", "default", "same"], default="lldslight",
                   help="glibc malloc tunables (lldslight/run/hostmem.py): lldslight's workers only (as its command runs), nobody, "
                        "or both sides")
    p.add_argument("--beta", type=float, default=0.0, help="KL coefficient (0 = no reference pass, both sides)")
    p.add_argument("--steps", type=int, default=2, help="measured steps per run (after one warm-up step)")
    p.add_argument("--rounds", type=int, default=harness.MIN_ROUNDS, help="alternating A B rounds per thread count; medians over rounds")
    p.add_argument("--threads", default="1,2", help="comma-separated torch thread counts, each measured in turn")
    p.add_argument("--precision", default="fp32,bf16", help="comma-separated, each measured in turn: fp32 (both sides fp32) "
                                                            "and/or bf16 (lldslight bf16-mixed, TRL bf16=True)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workload", choices=WORKLOADS, default="single",
                   help="single: single-turn work, LoRA on every layer, 1 update per step (the figures so far); lab: the "
                        "real-model lab's recipe (benchmarks/step_lab.py: LoRA on the top 8 layers, 4 updates per rollout "
                        "batch, a BM25 search then an answer), lldslight as shipped and with frozen_prefix off, against TRL; "
                        "both: one then the other")
    p.add_argument("--lab-rollout", action="append", default=[], metavar="KEY=VALUE",
                   help="lab workload, the shipped lldslight run only: a rollout setting to add to the recipe's (repeatable; "
                        "YAML values, e.g. a decode option today's lldslight lacks)")
    p.add_argument("--vllm", choices=["off", "on"], default="off",
                   help="also run lldslight with its rollouts from a vLLM server (lldslight-vllm; needs .venv-vllm: "
                        "bash scripts/setup_vllm.sh): step_time_ratio_vllm against TRL, vllm_ratio against the engine")
    p.add_argument("--vllm-python", default=str(VLLM_PYTHON), help="the interpreter that runs the vLLM server (in process: the worker)")
    p.add_argument("--vllm-mode", choices=["server", "inprocess"], default="server",
                   help="lldslight-vllm: a server (the worker runs here) or vllm.LLM in the worker, which then runs from --vllm-python")
    p.add_argument("--vllm-weights", choices=["lora", "merged"], default="lora",
                   help="lldslight-vllm: push the adapter (lora) or the merged weights (merged, --vllm-mode inprocess only)")
    p.add_argument("--only", choices=SIDES, default=None, help="run one side (debugging)")
    p.add_argument("--no-bounds", action="store_true", help="skip measuring bandwidth and sgemm ceilings")
    p.add_argument("--profile", action="store_true", help="profile one step of lldslight (or --only trl) and print where the time goes")
    p.add_argument("--trl-python", default=None, help="interpreter with trl installed (default: $LLDSLIGHT_TRL_PYTHON, else "
                                                      "benchmarks/.venv-trl, created on demand)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per worker run")
    p.add_argument("--json", default=None, help="write the figures here")
    harness.add_arguments(p)
    p.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:
        spec = json.loads(Path(args.spec).read_text())
        result = worker_trl(spec) if args.worker == "trl" else worker_lldslight(spec)
        Path(args.out).write_text(json.dumps(result))
        return

    if not 1 <= args.prompts <= len(PROMPTS):
        raise SystemExit(f"--prompts must be in 1..{len(PROMPTS)}, got {args.prompts}")
    precisions = [x.strip() for x in args.precision.split(",") if x.strip()]
    if not precisions or any(x not in PRECISIONS for x in precisions):
        raise SystemExit(f"--precision must be a comma-separated list of {', '.join(PRECISIONS)}, got {args.precision!r}")
    workloads = ["single", "lab"] if args.workload == "both" else [args.workload]
    lab_sides = list(_step_lab().SIDES)
    if args.only and "lab" in workloads and args.only not in lab_sides + ["lldslight-vllm"]:
        raise SystemExit(f"--only {args.only}: the lab workload runs {', '.join(lab_sides)} (and lldslight-vllm)")
    if args.only == "lldslight-today" and "single" in workloads:
        raise SystemExit("--only lldslight-today: a side of the lab workload only (--workload lab)")
    if (args.vllm == "on" or args.only == "lldslight-vllm") and not Path(args.vllm_python).is_file():
        raise SystemExit(f"--vllm-python: {args.vllm_python} does not exist (bash scripts/setup_vllm.sh makes .venv-vllm)")
    if args.vllm_weights == "merged" and args.vllm_mode != "inprocess":
        raise SystemExit("--vllm-weights merged: needs --vllm-mode inprocess (merged weights are copied into vLLM's model in process)")
    lab_rollout = lab_rollout_overrides(args.lab_rollout)
    from lldslight.policy import PolicyConfig, resolve_model_dir

    model_dir = str(resolve_model_dir(PolicyConfig()))  # de-quantises the bundled GGUF once
    shape = bounds.model_shape(model_dir)
    spec = {
        "model_dir": model_dir,
        "prompts": PROMPTS[: args.prompts],
        "group_size": args.group_size,
        "max_new_tokens": args.max_new_tokens,
        "micro_batch": args.micro_batch,
        "micro_batch_tokens": args.micro_batch_tokens,
        "logprob_chunk_size": args.logprob_chunk_size,
        "lora_r": args.lora_r,
        "activation_budget_mb": args.activation_budget_mb,
        "malloc": args.malloc,
        "shared_prefix": args.shared_prefix != "off",
        "beta": args.beta,
        "steps": args.steps,
        "warmup": 1,
        "seed": args.seed,
        "vllm_python": args.vllm_python,
        "vllm_mode": args.vllm_mode,
        "vllm_weights": args.vllm_weights,
    }
    runs = ["lldslight", "lldslight-auto"] if args.lldslight_checkpointing == "on,auto" else ["lldslight"]
    if args.shared_prefix == "both":
        runs.append("lldslight-unshared")
    if args.vllm == "on":
        runs.append("lldslight-vllm")
    specs, sides = {}, {}
    if "single" in workloads:
        specs["single"] = dict(spec, workload="single")
        sides["single"] = [args.only] if args.only else (["lldslight"] if args.profile else runs + ["trl"])
    if "lab" in workloads:
        specs["lab"] = lab_spec(args, precisions[0], lab_rollout)
        with_vllm = lab_sides[:-1] + ["lldslight-vllm", lab_sides[-1]] if args.vllm == "on" else lab_sides  # TRL last
        sides["lab"] = [args.only] if args.only else (["lldslight"] if args.profile else with_vllm)
    pythons = dict.fromkeys(LLDSLIGHT_SIDES, sys.executable)
    if args.vllm_mode == "inprocess":  # vllm.LLM inside the worker: it runs from vLLM's environment
        pythons["lldslight-vllm"] = args.vllm_python
    if any("trl" in s for s in sides.values()):
        pythons["trl"] = ensure_trl_venv(args.trl_python)
    if args.profile:
        first = workloads[0]
        profile(args, dict(specs[first], precision=precisions[0]), sides[first], pythons)
        return
    policy = harness.policy_from_args(args)
    report: dict = {"workload": args.workload, "machine": machine()}
    if "single" in specs:
        report.update(config=recorded(specs["single"]), precisions={})
    if "lab" in specs:
        report["lab"] = {"config": recorded(specs["lab"]), "trl": trl_lab_settings(specs["lab"]),
                         "what_differs": list(_step_lab().DIFFERENCES), "precisions": {}}
    measured_bounds: dict = {}
    for workload in workloads:
        # the single workload's figures stay where they always were (the report's top level)
        block = report if workload == "single" else report["lab"]
        for precision in precisions:
            runs_p = block["precisions"][precision] = {"threads": {}}
            for t in [int(x) for x in args.threads.split(",")]:
                res = measure_threads(t, args, dict(specs[workload], precision=precision), sides[workload], pythons, policy, shape,
                                      measured_bounds.get(t), with_bounds=workload == "single")
                if "bounds" in res:
                    measured_bounds[t] = res["bounds"]
                runs_p["threads"][str(t)] = res
                print_threads(res, args, sides[workload], specs[workload])
                if args.json:  # after each run: a long run that stops later keeps what it measured
                    Path(args.json).write_text(json.dumps(report, indent=1))
            for key in ("step_time_ratio", "step_time_ratio_auto", "step_time_ratio_unshared", "step_time_ratio_today",
                        "step_time_ratio_vllm", "shared_prefix_ratio", "today_ratio", "vllm_ratio", "vllm_sync_s"):
                if runs_p["threads"] and all(key in r for r in runs_p["threads"].values()):
                    runs_p[key] = {t: r[key] for t, r in runs_p["threads"].items()}
                    block.setdefault(key, {})[precision] = runs_p[key]
    report["closing_note"] = closing_note(report)
    print("\n" + "\n".join(report["closing_note"]))
    report["quiet"] = all_quiet(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


def lab_rollout_overrides(items: list[str]) -> dict:
    """--lab-rollout KEY=VALUE items as rollout settings (values read as YAML: true, 3, 0.5)."""
    import yaml

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"step: --lab-rollout {item!r}: expected KEY=VALUE (e.g. greedy=false)")
        out[key.strip()] = yaml.safe_load(value)
    if out:
        _step_lab().check_rollout_overrides(out)
    return out


def lab_spec(args, precision: str, lab_rollout: dict) -> dict:
    """The lab workload's settings (read from the recipe; step_lab.spec) with this run's."""
    lab = _step_lab().spec(precision, args.seed)
    lab.update(workload="lab", steps=args.steps, warmup=1, seed=args.seed, malloc=args.malloc, lab_rollout=lab_rollout,
               vllm_python=args.vllm_python, vllm_mode=args.vllm_mode, vllm_weights=args.vllm_weights)
    rows = len(lab["prompts"]) * lab["group_size"]
    trl_batch_kwargs(rows, lab["micro_batch"], lab["updates"])  # a recipe TRL cannot split alike fails here, before any run
    return lab


def trl_lab_settings(spec: dict) -> dict:
    """What TRL's side of the lab workload is given, as the report records it."""
    rows = len(spec["prompts"]) * spec["group_size"]
    return {"batch": trl_batch_kwargs(rows, spec["micro_batch"], spec["updates"]), "lora": _step_lab().trl_lora_kwargs(spec),
            "optimiser_steps_per_unit": spec["updates"], "rollout": "rollout_func (step_lab.SearchR1Rollout)"}


def all_quiet(report: dict) -> bool:
    blocks = [b for b in (report, report.get("lab")) if b and "precisions" in b]
    return all(r["quiet"]["quiet"] for b in blocks for p in b["precisions"].values() for r in p["threads"].values())


def closing_note(report: dict) -> list[str]:
    """Per workload, precision and thread count: the step ratio against the 0.5x target (the lab
    workload: against TRL and against today's lldslight), and lldslight's decode step against the
    physical limit (and the 40% target in bf16)."""
    lines = []

    def target(name: str, r: float) -> str:
        return f"{name} {r:.3f} = {r / TARGET_RATIO:.2f}x the {TARGET_RATIO}x target ({'met' if r <= TARGET_RATIO else 'missed'});"

    for precision, runs in report.get("precisions", {}).items():
        for t, res in runs["threads"].items():
            parts = [f"{precision}, {t} thread(s):"]
            for key, name in (("step_time_ratio", "step ratio"), ("step_time_ratio_auto", "step ratio (auto)"),
                              ("step_time_ratio_unshared", "step ratio (shared prefix off)"),
                              ("step_time_ratio_vllm", "step ratio (rollouts from vLLM)")):
                if key in res:
                    parts.append(target(name, res[key]))
            if "vllm_ratio" in res:
                parts.append(f"vLLM / engine: step {res['vllm_ratio']:.3f}, generation "
                             f"{res['vllm_ratios']['generation_s']['ratio_of_medians']:.3f} (above 1: vLLM slower);")
            if "shared_prefix_ratio" in res:
                parts.append(f"shared prefix on / off: step {res['shared_prefix_ratio']:.3f};")
            f = res.get("fractions", {}).get("lldslight")
            if f is not None:
                goal = f" (target {TARGET_DECODE_FRACTION:.0%}: {'met' if f['generation_fraction_of_bound'] >= TARGET_DECODE_FRACTION else 'missed'})" \
                    if precision == "bf16" else ""
                parts.append(f"decode step at {f['generation_fraction_of_bound']:.0%} of the physical limit{goal}, "
                             f"{f['generation_fraction_of_blas']:.0%} of its matmuls alone; update at "
                             f"{f['update_fraction_of_ceiling']:.0%} of the peak")
            lines.append(" ".join(parts))
    for precision, runs in report.get("lab", {}).get("precisions", {}).items():
        for t, res in runs["threads"].items():
            parts = [f"lab, {precision}, {t} thread(s):"]
            for key, name in (("step_time_ratio", "step ratio vs TRL"), ("today_ratio", "step ratio vs today's lldslight"),
                              ("step_time_ratio_today", "today's lldslight vs TRL")):
                if key in res:
                    parts.append(target(name, res[key]) if key != "step_time_ratio_today" else f"{name} {res[key]:.3f};")
            lines.append(" ".join(parts))
    lines.append("quiet machine: every run" if all_quiet(report) else "NOT QUIET: some runs had other load (see each run's quiet line)")
    return lines


def recorded(spec: dict) -> dict:
    """The settings as a report keeps them: without the prompts (the lab's: their ids), paths in
    the repository relative to it and the model's cache folder under "~" (a committed report names
    no machine's folders)."""
    out = {k: v for k, v in spec.items() if k != "prompts"}
    if spec.get("workload") == "lab":
        out["prompt_ids"] = [p["id"] for p in spec["prompts"]]

    def short(path: str) -> str:
        for prefix, shown in ((str(ROOT) + os.sep, ""), (str(Path.home()) + os.sep, "~" + os.sep)):
            if path.startswith(prefix):
                return shown + path[len(prefix):]
        return path

    if "model_dir" in out:
        out["model_dir"] = short(str(out["model_dir"]))
    if "vllm_python" in out:
        out["vllm_python"] = short(str(out["vllm_python"]))
    if "retriever" in out:
        out["retriever"] = dict(out["retriever"], corpus=short(out["retriever"]["corpus"]))
    return out


def machine() -> dict:
    import platform

    import torch

    from lldslight.policy import cpu_description

    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        **cpu_description(),
    }


if __name__ == "__main__":
    main()
