"""The real-model lab's workload for benchmarks/step.py (``--workload lab``): one rollout batch of
lab/configs/real_lm.yaml and its k updates, on lldslight's side and on TRL's.

The recipe (lab/configs/real_lm.yaml at the arm benchmarks/lab_step.py times): the demo's warm start
of SmolLM2-135M-Instruct, LoRA r 16 on the top 8 of 30 layers, 4 prompts x G 4 = 16 rollouts, 4
updates per rollout batch (mini-batches of 4 rows, micro-batches of 4), gradient checkpointing,
one search then an answer per rollout (Search-R1 tags, ``max_turns: 1``, 40 new tokens a turn, 2
passages of at most 120 tokens, 220 response tokens) with BM25 over the demo's knowledge base, the
exact-match reward.

lldslight's side is the recipe itself, built through lldslight's CLI from the arguments
benchmarks/lab_step.py runs it with (``lab_step.fit_args``), run twice: as shipped
(``model.update.frozen_prefix: true``) and as "lldslight-today" (``frozen_prefix: false``). Not
timed: LLDMonitor's after-step forward, RunSummary and checkpoints (TRL does none of them). Every
step trains on the same 4 prompts, the first batch the recipe's data module draws (so both sides
see the same prompts every step).

TRL's side (GRPOTrainer, TRL 1.16) does the same work:

- the same LoRA layers: peft ``LoraConfig(layers_to_transform=[22..29])`` on all linear layers;
- the same k updates per rollout batch. lldslight's ``updates_per_rollout: k`` splits the 16 rows
  into k mini-batches and takes one optimiser step on each: every row is trained on once. In TRL
  that is ``steps_per_generation = rows / micro`` with ``gradient_accumulation_steps = rows / (k x
  micro)`` and ``num_iterations = 1``: one generation batch of 16 rows, k optimiser steps on 4 rows
  each, pi_old's log-probs computed over the batch first (TRL computes them whenever generation and
  optimiser steps are not aligned). ``num_iterations = k`` would be k passes over all 16 rows per
  generation (PPO's epochs, mu in the GRPO paper): k times the update work, not the same unit. The
  unit timed is one generation batch and its k optimiser steps (k of TRL's global steps);
- the same search-then-answer loop, as TRL's ``rollout_func`` (its hook for custom multi-turn
  rollouts). TRL's built-in tool calling (``tools=``, ``environment_factory``) cannot play this
  protocol: it parses JSON tool calls of the chat template's format, renders each result as a
  ``tool`` message of the template, and stops a turn only at EOS or the whole completion budget;
  the Search-R1 turn ends at ``</search>`` or ``</answer>`` and the passages follow in the same
  assistant text. The rollout_func decodes each turn with TRL's own generation path (the trainer's
  unwrapped model, ``transformers.generate`` with the trainer's generation config: temperature 1,
  no top-p / top-k) plus the protocol's stop strings and per-turn budget, retrieves with the same
  BM25 retriever, and re-encodes prompt + first turn + passages for the second turn, as TRL's own
  tool loop does (no KV cache is carried across turns; lldslight's engine appends the passages to
  its cache). The protocol's text (tags, the passages' format, the invalid-action message, the
  prompt's tokens) comes from lldslight.rollout.protocol, so both sides build identical rows; the
  passages are masked out of TRL's loss with ``env_mask`` as lldslight's loss mask does;
- the same reward: the recipe's reward class (exact match), called on the model's own actions.

What still differs: the sampled tokens (each side's own random stream; the per-step work, model
and passage tokens and searches, is recorded beside the times), and how each side schedules the
decode (lldslight batches every rollout through its turns in one cache; TRL generates a turn for
the whole batch and a second turn for the rows that searched).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import os
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

if __package__:
    from . import lab_step
else:
    import lab_step

SIDES = ("lldslight", "lldslight-today", "trl")
FROZEN_PREFIX = {"lldslight": True, "lldslight-today": False, "lldslight-vllm": True}  # model.update.frozen_prefix per lldslight run
PRECISION = {"fp32": "fp32", "bf16": "bf16-mixed"}  # policy.precision per benchmark precision
# What is not the same on both sides (the report carries these lines; the module's docstring says why).
DIFFERENCES = (
    "TRL's turns are decoded by its rollout_func (TRL's hook for custom multi-turn rollouts) with TRL's generation path "
    "(transformers.generate on the trainer's unwrapped model and generation config) plus the protocol's stop strings: "
    "TRL's built-in tool calling parses JSON tool calls and stops a turn only at EOS or the completion budget",
    "TRL re-encodes prompt + first turn + passages for the second turn, as its own tool loop does; lldslight appends "
    "the passages to the KV cache it carries across turns",
    "TRL decodes a turn for the whole batch, then a second turn for the rows that searched; lldslight batches every "
    "rollout through its turns continuously",
    "each side samples its own tokens (own random stream): the work per step (model tokens, passage tokens, searches) "
    "is recorded beside the times",
    "not timed on lldslight's side: LLDMonitor's after-step forward, RunSummary, checkpoints (TRL runs none of them)",
)


@contextlib.contextmanager
def at_root():
    """The recipe names its corpus, data and warm start relative to the repository's root."""
    here = os.getcwd()
    os.chdir(ROOT)
    try:
        yield
    finally:
        os.chdir(here)


def build_cli(frozen_prefix: bool, precision: str, seed: int):
    """The lab's run through lldslight's own CLI (the recipe, the arm, the warm start), built and not
    run: its module, data module and callbacks as ``lldslight fit`` would make them."""
    from lightning.pytorch.cli import LightningCLI

    from lldslight.cli.lightning import TRAINER_DEFAULTS
    from lldslight.data.datamodule import SearchQADataModule
    from lldslight.module import GRPOModule

    args = lab_step.fit_args(lab_step.RECIPE, lab_step.ARM, lab_step.POLICY, frozen_prefix, 1, seed)
    args += ["--model.policy.precision", PRECISION[precision], "--trainer.logger", "false"]
    # The lldslight command is this LightningCLI over these classes with these defaults (lldslight/cli/lightning.py);
    # what it adds (lists replaced across config files, deprecated flat keys, resume checks) leaves
    # this recipe and arm as they are.
    with at_root():
        return LightningCLI(GRPOModule, SearchQADataModule, args=args, run=False, trainer_defaults=TRAINER_DEFAULTS,
                            seed_everything_default=seed, auto_configure_optimizers=False, save_config_callback=None)


def search_rollout(cli):
    from lldslight.callbacks import SearchRollout

    found = [c for c in cli.trainer.callbacks if isinstance(c, SearchRollout)]
    if len(found) != 1:
        raise SystemExit(f"step: {lab_step.RECIPE} has {len(found)} SearchRollout callbacks, expected one")
    return found[0]


def spec(precision: str, seed: int) -> dict:
    """What both sides need, read from the recipe as lldslight builds it (``settings``) and the
    prompts of its data module's first batch. Plain JSON (the TRL worker runs in its own virtual
    environment, without Lightning)."""
    if not (ROOT / lab_step.POLICY).exists():
        raise SystemExit(f"step: --workload lab needs the demo's warm start at {lab_step.POLICY}: run scripts/demo.sh once (it makes it)")
    cli = build_cli(True, precision, seed)
    data = cli.datamodule
    with at_root():
        data.prepare_data()
        data.setup("fit")
        batch = next(iter(data.train_dataloader()))
    prompts = [{"id": e.id, "question": e.question, "golden_answers": list(e.golden_answers), "data_source": e.data_source,
                "messages": e.messages, "group_id": e.group_id} for e in batch]
    out = {**settings(cli), "prompts": prompts}
    out["lora"]["linear_modules"] = linear_names(out["model_dir"])
    return out


def linear_names(model_dir: str) -> list[str]:
    """The names of the model's linear layers but the output head, as lldslight's policy spells out
    "all-linear" when only some layers are adapted (peft refuses the string with
    layers_to_transform). Read from a weightless (meta-device) copy of the model."""
    import torch
    from torch import nn
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    head = model.get_output_embeddings()
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear) and m is not head})


def settings(cli) -> dict:
    """The recipe's rollout, retriever, reward, LoRA, update and optimiser settings from the built CLI."""
    rollout = search_rollout(cli)
    module = cli.model
    policy, update, optim = module.policy_config, module.update_config, module.optim_config
    retriever, reward = rollout.retriever, rollout.reward
    return {
        "recipe": lab_step.RECIPE,
        "arm": lab_step.ARM,
        "model_dir": str((ROOT / policy.model).resolve()),
        "group_size": rollout.config.group_size,
        "rollout": dataclasses.asdict(rollout.config),
        "retriever": {"class": f"{type(retriever).__module__}.{type(retriever).__qualname__}",
                      "corpus": str((ROOT / retriever.corpus).resolve()), "settings": retriever.index_settings()},
        "reward": {"class": f"{type(reward).__module__}.{type(reward).__qualname__}", "kwargs": dict(vars(reward))},
        "lora": {"r": policy.lora.r, "alpha": policy.lora.alpha, "dropout": policy.lora.dropout,
                 "target_modules": policy.lora.target_modules, "layers_to_transform": list(policy.lora.layers_to_transform or [])},
        "updates": update.updates_per_rollout,
        "micro_batch": update.micro_batch_size,
        "beta": update.kl_coef,
        "clip_eps": update.clip_eps,
        "grad_clip": update.grad_clip,
        "lr": optim.lr,
        "weight_decay": optim.weight_decay,
    }


def named(path: str):
    module_name, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module_name), attr)


# -- lldslight's side ---------------------------------------------------------------------------------


def vllm_backend(spec: dict):
    """The "lldslight-vllm" side's backend, for both workloads: a vLLM server on loopback started
    from ``spec["vllm_python"]`` (.venv-vllm) and stopped with the worker, or ``vllm.LLM`` in the
    worker (``vllm_mode: inprocess``), with the adapter (or the merged weights) pushed when the
    policy changed: at the start of each rollout, inside generation_s (its cost is also sync_s).
    The caller runs it without the weight-sync probe (``sync_tolerance=None``), which would push
    the weights after the step, outside the timed step; the probe's own cost is left out of every
    side alike (the engine's runs after the Timer's end of step)."""
    import functools

    from lldslight.rollout import VLLMGenerate

    return functools.partial(VLLMGenerate, mode=spec.get("vllm_mode", "server"), python=spec["vllm_python"],
                             weights=spec.get("vllm_weights", "lora"))


def lldslight_parts(spec: dict, side: str, rollout_overrides: dict):
    """(module, SearchRollout, examples) for one lldslight run of the lab workload: the recipe as
    built by the CLI with frozen_prefix on (as shipped) or off (today), the recipe's SearchRollout
    with ``rollout_overrides`` applied (the shipped run only: settings today's lldslight lacks), and
    the spec's prompts."""
    from lldslight.data.example import QAExample

    cli = build_cli(FROZEN_PREFIX[side], spec["precision"], spec["seed"])
    rollout = search_rollout(cli)
    if side == "lldslight-vllm":  # the shipped run with its rollouts from vLLM
        rollout.use_backend(vllm_backend(spec))
        rollout.sync_tolerance = None  # vllm_backend says why
    if rollout_overrides:
        rollout.config = dataclasses.replace(rollout.config, **rollout_overrides)
    examples = [QAExample(**p, split="train") for p in spec["prompts"]]
    return cli.model, rollout, examples


def check_rollout_overrides(overrides: dict) -> None:
    """One line naming a --lab-rollout key the rollout settings do not have."""
    from lldslight.rollout import RolloutConfig

    fields = {f.name for f in dataclasses.fields(RolloutConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise SystemExit(f"step: --lab-rollout {unknown[0]}: not a rollout setting of this lldslight (RolloutConfig has "
                         f"{', '.join(sorted(fields))})")


# -- TRL's side ---------------------------------------------------------------------------------------


def trl_lora_kwargs(spec: dict) -> dict:
    """peft LoraConfig arguments for TRL's side: the recipe's adapter, on the same layers."""
    lora = spec["lora"]
    targets = lora["target_modules"]
    if targets == "all-linear" and lora["layers_to_transform"]:
        targets = lora["linear_modules"]  # spelled out as lldslight does (linear_names)
    return {"r": lora["r"], "lora_alpha": lora["alpha"], "lora_dropout": lora["dropout"], "target_modules": targets,
            "layers_to_transform": lora["layers_to_transform"] or None, "task_type": "CAUSAL_LM"}


def trl_rows(spec: dict) -> list[dict]:
    """TRL's train dataset: the spec's prompts with what the reward reads."""
    return [{"prompt": p["messages"], "golden_answers": p["golden_answers"], "question": p["question"], "data_source": p["data_source"]}
            for p in spec["prompts"]]


class SearchR1Rollout:
    """TRL's ``rollout_func`` playing the Search-R1 protocol as lldslight's engine does (episode.py's
    rules): a turn ends at EOS, ``</search>``, ``</answer>`` or its budget; an answer ends the
    rollout, as does the last turn (``max_turns``) or the response budget; a search appends the
    retrieved passages, anything else the invalid-action message, and the rollout decodes its next
    turn after them. ``stats`` holds the last call's generation and retrieval seconds and work."""

    def __init__(self, spec: dict, tokenizer) -> None:
        from lldslight.rollout.protocol import STOP_TAGS, eos_ids

        self.cfg = spec["rollout"]
        self.tokenizer = tokenizer
        self.eos = eos_ids(tokenizer)
        self.stop = list(STOP_TAGS)
        retriever = spec["retriever"]
        self.retriever = named(retriever["class"])(corpus=retriever["corpus"], **retriever["settings"], show_progress=False)
        self.retriever.load()
        self.stats: dict = {}

    def turn_end(self, ids: list[int]) -> int:
        """How many of a turn's decoded ids it keeps: up to EOS or a completed stop tag (the last
        12 tokens hold a freshly completed one, as episode.py reads it), else all of them."""
        for t, tok in enumerate(ids):
            if tok in self.eos:
                return t + 1
            tail = self.tokenizer.decode(ids[max(0, t - 11): t + 1], skip_special_tokens=False)
            if any(tag in tail for tag in self.stop):
                return t + 1
        return len(ids)

    def decode_turn(self, trainer, rows: list[list[int]], budget: int) -> list[list[int]]:
        """One turn for every row in ``rows`` (token ids so far), through TRL's generation path:
        its unwrapped model and generation config, left-padded as _generate_single_turn pads."""
        import torch
        from trl.models import unwrap_model_for_generation
        from trl.trainer.utils import pad

        tok = self.tokenizer
        tensors = [torch.tensor(r) for r in rows]
        ids = pad(tensors, padding_value=tok.pad_token_id, padding_side="left")
        mask = pad([torch.ones_like(t) for t in tensors], padding_value=0, padding_side="left")
        config = copy.deepcopy(trainer.generation_config)
        config.max_new_tokens = budget
        config.stop_strings = self.stop  # the protocol's turn end (transformers needs the tokenizer for it)
        config.eos_token_id = self.eos
        with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator, generation_kwargs=trainer.generation_kwargs,
                                         gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs) as model, torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config, tokenizer=tok)
        new = out[:, ids.size(1):].tolist()
        return [r[: min(self.turn_end(r), budget)] for r in new]

    def __call__(self, prompts: list, trainer) -> dict:
        from lldslight.rollout.protocol import INVALID_ACTION, format_observation, observation_ids, parse_action, prompt_token_ids

        cfg, tok = self.cfg, self.tokenizer
        t0 = time.perf_counter()
        retrieval = 0.0
        prompt_ids = [prompt_token_ids(tok, p) for p in prompts]
        completion = [[] for _ in prompts]
        env_mask = [[] for _ in prompts]
        actions: list[list[str]] = [[] for _ in prompts]
        response_len = [0] * len(prompts)
        searches = 0
        active = list(range(len(prompts)))
        for turn_index in range(cfg["max_turns"] + 1):
            if not active:
                break
            budgets = [min(cfg["max_new_tokens"], cfg["max_response_tokens"] - response_len[i]) for i in active]
            turns = self.decode_turn(trainer, [prompt_ids[i] + completion[i] for i in active], max(budgets))
            queries, observe, still = [], {}, []
            for i, turn, budget in zip(active, turns, budgets):
                turn = turn[:budget]
                completion[i] += turn
                env_mask[i] += [1] * len(turn)
                response_len[i] += len(turn)
                text = tok.decode(turn, skip_special_tokens=True)
                actions[i].append(text)
                kind, content = parse_action(text)
                if kind == "answer" or turn_index == cfg["max_turns"] or response_len[i] >= cfg["max_response_tokens"]:
                    continue
                if kind == "search" and content:
                    queries.append((i, content))
                else:
                    observe[i] = INVALID_ACTION
                still.append(i)
            if queries:
                r0 = time.perf_counter()
                found = self.retriever.search([q for _, q in queries], cfg["topk"])
                retrieval += time.perf_counter() - r0
                searches += len(queries)
                observe.update({i: format_observation(p) for (i, _), p in zip(queries, found)})
            active = []
            for i in still:
                room = cfg["max_response_tokens"] - response_len[i]
                obs = observation_ids(tok, observe[i], cfg["max_obs_tokens"])[: max(room, 0)]
                completion[i] += obs
                env_mask[i] += [0] * len(obs)
                response_len[i] += len(obs)
                if response_len[i] < cfg["max_response_tokens"]:
                    active.append(i)
        self.stats = {"generation_s": time.perf_counter() - t0, "retrieval_s": retrieval, "searches": searches,
                      "obs_tokens": sum(len(m) - sum(m) for m in env_mask)}
        return {"prompt_ids": prompt_ids, "completion_ids": completion, "logprobs": None, "env_mask": env_mask, "actions": actions}


def trl_reward(spec: dict):
    """The recipe's reward on the model's own actions (what lldslight's reward sees: a ModelText)."""
    from lldslight.rewards import ModelText, RewardCaller

    reward = RewardCaller(named(spec["reward"]["class"])(**spec["reward"]["kwargs"]))

    def lab_reward(completions, actions, golden_answers, question, data_source, **kwargs):
        return [float(reward(ModelText(a), g, question=q, data_source=d))
                for a, g, q, d in zip(actions, golden_answers, question, data_source)]

    return lab_reward
