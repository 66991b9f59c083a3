"""Supervised warm start: teach a policy the Search-R1 action format before GRPO.

GRPO learns only from groups whose rewards differ. A small instruct model that never writes
``<search>`` or ``<answer>`` earns EM 0 on every rollout, so every advantage is 0 and RL has nothing to
work with (measured: SmolLM2-135M-Instruct, 0 of 29 samples used a tag). Search-R1 sidesteps this with
3B+ models; at small scale the standard fix is a short supervised phase on gold trajectories:

    <search> ENTITY </search>  <information>...retrieved passages...</information>  <answer> GOLD </answer>

Each gold trajectory is a ``Layout`` built with the rollout engine's own pieces (``prompt_token_ids``,
separately tokenised turns, ``observation_ids`` cut at ``max_obs_tokens``) and packed by its
``pack``, so the warm-started model learns exactly the token layout GRPO will later sample. The
loss is cross-entropy on the model's own turns only; observation and prompt tokens carry none, as
in RL (docs/algorithm.md §1).

The search queries are the question's supporting titles when the data has them (the synthetic
knowledge base does: ``metadata.supporting_titles``), else the question itself. With
``require_answer_in_context`` an example is kept only when a gold answer occurs in what the
retriever returned, so the model is taught to read, not to guess.

    lldslight sft --data train.jsonl --corpus corpus.jsonl --out runs/warmstart [--model ...]

writes a plain Hugging Face model directory (LoRA merged); point ``model.policy.model`` at it.
"""
from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import TQDMProgressBar
from torch import Tensor

from lldslight.data.example import QAExample
from lldslight.errors import ArgumentParser, ConfigError, UserError
from lldslight.update.logprobs import token_logprobs
from lldslight.policy.config import LoRAConfig, PolicyConfig
from lldslight.policy.load import load_policy, save_merged
from lldslight.policy.precision import model_arithmetic
from lldslight.retrieval.base import Retriever
from lldslight.rewards import normalize_answer
from lldslight.rollout import Layout, format_observation, observation_ids, pack, prompt_token_ids
from lldslight.run.writes import check_out_dir, check_writable


@dataclass
class GoldConfig:
    """How gold trajectories are written.

    Args:
        topk: passages per search (use the value the RL rollout will use).
        max_obs_tokens: an observation is cut to this many tokens, as the rollout cuts it.
        max_searches: the most searches in a gold trajectory (match the rollout's max_turns, or the
            model learns actions it will never be allowed to take).
        over_budget: what to do with an example whose gold needs more searches: "skip" it, or
            "truncate" its searches to max_searches and answer anyway (with
            require_answer_in_context false, the model then learns to guess where it cannot know,
            which keeps its answers uncertain there instead of deterministic).
        require_answer_in_context: keep an example only when a gold answer occurs in its observations.
        end_with_eos: append the EOS token after the answer turn.
    """

    topk: int = 3
    max_obs_tokens: int = 500
    max_searches: int = 4
    over_budget: Literal["skip", "truncate"] = "skip"
    require_answer_in_context: bool = True
    end_with_eos: bool = False


def gold_queries(example: QAExample) -> list[str]:
    """What a competent agent searches for: the supporting titles in hop order, else the question."""
    titles = example.meta.get("supporting_titles") or []
    return [str(t) for t in titles] or [example.question]


def gold_turns(example: QAExample, retriever: Retriever, cfg: GoldConfig) -> Optional[list[tuple[str, bool]]]:
    """The response as (text, is_model_turn) pieces, or None when the example cannot be used."""
    queries = gold_queries(example)
    if (len(queries) > cfg.max_searches and cfg.over_budget == "skip") or not example.golden_answers:
        return None
    queries = queries[: cfg.max_searches]
    results = retriever.search(queries, cfg.topk)
    pieces: list[tuple[str, bool]] = []
    for query, passages in zip(queries, results):
        pieces.append((f"<search> {query} </search>", True))
        pieces.append((format_observation(passages), False))
    if cfg.require_answer_in_context:
        context = normalize_answer(" ".join(p.contents for passages in results for p in passages))
        if not any(normalize_answer(a) and normalize_answer(a) in context for a in example.golden_answers):
            return None
    pieces.append((f"<answer> {example.golden_answers[0]} </answer>", True))
    return pieces


def encode_gold(example: QAExample, pieces: list[tuple[str, bool]], tokenizer, cfg: GoldConfig) -> Layout:
    """The gold trajectory in the rollout's token layout: the prompt as the rollout builds it, each
    model turn tokenised on its own (action 0, 1, ...), observations cut as the rollout cuts them."""
    layout = Layout(prompt_token_ids(tokenizer, example.messages))
    action = 0
    for text, is_model in pieces:
        if is_model:
            layout.add(tokenizer(text, add_special_tokens=False)["input_ids"], action)
            action += 1
        else:
            layout.add(observation_ids(tokenizer, text, cfg.max_obs_tokens), -1)
    if cfg.end_with_eos and tokenizer.eos_token_id is not None:
        layout.segments[-1][0].append(tokenizer.eos_token_id)  # part of the last (answer) action
    return layout


def build_gold_set(examples: list[QAExample], retriever: Retriever, tokenizer, cfg: GoldConfig) -> tuple[list[Layout], dict]:
    """Encoded gold trajectories of every usable example, and counts of what was skipped and why."""
    rows, stats = [], {"examples": len(examples), "kept": 0, "too_many_searches": 0, "truncated": 0, "answer_not_retrieved": 0}
    for ex in examples:
        if len(gold_queries(ex)) > cfg.max_searches:
            if cfg.over_budget == "skip":
                stats["too_many_searches"] += 1
                continue
            stats["truncated"] += 1
        pieces = gold_turns(ex, retriever, cfg)
        if pieces is None:
            stats["answer_not_retrieved"] += 1
            continue
        rows.append(encode_gold(ex, pieces, tokenizer, cfg))
    stats["kept"] = len(rows)
    return rows, stats


def pad_batch(rows: list[Layout], pad_id: int) -> dict[str, Tensor]:
    """The rollout's packer (lldslight.rollout.pack): right-padded input_ids, attention_mask,
    loss_mask (the model's turns), action_id and prompt_len."""
    return pack(rows, pad_id)


def sft_loss(model, batch: dict[str, Tensor]) -> Tensor:
    """Mean negative log-likelihood of the model's own tokens (chunked: no full-vocabulary logits)."""
    logp, _ = token_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["loss_mask"])
    mask = batch["loss_mask"].clone()
    mask[:, 0] = False
    return -logp[mask].mean()


class SFTModule(pl.LightningModule):
    """Cross-entropy on gold trajectories; the policy is built from the same PolicyConfig as GRPO's."""

    def __init__(self, policy: PolicyConfig, lr: float = 5e-4, weight_decay: float = 0.0, warmup_steps: int = 2):
        super().__init__()
        self.policy_config = policy
        self.lr, self.weight_decay, self.warmup_steps = lr, weight_decay, warmup_steps
        self.policy, self.tokenizer = load_policy(policy)

    def on_fit_start(self) -> None:
        # from_pretrained returns eval mode; HF's gradient checkpointing only acts in train mode.
        self.policy.train()

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = sft_loss(self.policy, batch)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"sft: non-finite loss {loss.item()} at step {self.global_step}")
        self.log("sft/loss", loss, prog_bar=True, on_step=True)
        return loss

    def configure_optimizers(self):
        params = [p for p in self.policy.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=self.lr, weight_decay=self.weight_decay)
        warmup = max(1, self.warmup_steps)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def warm_start(
    examples: list[QAExample],
    retriever: Retriever,
    out: str | Path,
    policy: Optional[PolicyConfig] = None,
    gold: Optional[GoldConfig] = None,
    epochs: int = 1,
    batch_size: int = 4,
    lr: float = 5e-4,
    seed: int = 0,
    accelerator: str = "auto",
    meta: Optional[dict] = None,
) -> dict:
    """Train on gold trajectories and save the merged model to ``out``, with the summary and
    ``meta`` in its lldslight_export.json; returns the summary."""
    policy = policy or PolicyConfig(precision="fp32", lora=LoRAConfig(r=16, alpha=32))
    gold = gold or GoldConfig()
    out = Path(out)
    pl.seed_everything(seed, verbose=False)
    module = SFTModule(policy, lr=lr)
    rows, stats = build_gold_set(examples, retriever, module.tokenizer, gold)
    if not rows:  # not one value out of range: the data and max_searches together give nothing to train on
        raise ConfigError(
            f"sft: none of {stats['examples']} examples gave a usable gold trajectory "
            f"({stats['too_many_searches']} need more than max_searches={gold.max_searches} searches, "
            f"{stats['answer_not_retrieved']} had no gold answer in the retrieved passages)"
        )
    print(f"[lldslight] sft: {stats['kept']} gold trajectories of {stats['examples']} examples "
          f"(skipped: {stats['too_many_searches']} need > {gold.max_searches} searches, "
          f"{stats['answer_not_retrieved']} answer not retrieved; {stats['truncated']} truncated to {gold.max_searches} searches)", flush=True)
    pad_id = module.tokenizer.pad_token_id
    loader = torch.utils.data.DataLoader(
        rows, batch_size=batch_size, shuffle=True, collate_fn=lambda b: pad_batch(b, pad_id),
        generator=torch.Generator().manual_seed(seed),
    )
    trainer = pl.Trainer(
        accelerator=accelerator, devices=1, max_epochs=epochs, logger=False, enable_checkpointing=False,
        enable_model_summary=False, gradient_clip_val=1.0, log_every_n_steps=1,
        # tqdm, not rich: its updates also reach a log file when the output is not a terminal
        callbacks=[TQDMProgressBar(refresh_rate=1)],
    )
    t0 = time.perf_counter()
    trainer.fit(module, loader)
    seconds = time.perf_counter() - t0
    final_loss = float(trainer.callback_metrics.get("sft/loss", float("nan")))
    summary = {
        "policy": dataclasses.asdict(policy), "gold": dataclasses.asdict(gold), "epochs": epochs,
        "batch_size": batch_size, "lr": lr, "seed": seed, "steps": trainer.global_step,
        "final_loss": final_loss, "seconds": round(seconds, 1), **stats,
    }
    # Saved in the dtype the policy trained in (as "auto" resolved on this machine: fp32 -> float32, bf16 -> bfloat16).
    dtype = torch.float32 if model_arithmetic(module.policy).precision == "fp32" else torch.bfloat16
    save_merged(module.policy.cpu(), module.tokenizer, out, dtype, {"warm_start": summary, **(meta or {})})
    print(f"[lldslight] sft: {trainer.global_step} steps in {seconds:.0f} s, final loss {final_loss:.3f} -> {out}", flush=True)
    return summary


def _stat_key(path: str) -> Optional[list[int]]:
    """[size, mtime_ns] of a file, None when it is not one (a missing file is reported later)."""
    try:
        st = Path(path).stat()
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns]


def _cache_key(request: dict) -> dict:
    """A warm-start request without the policy's deprecated ``dtype`` (its ``precision`` holds what
    it meant): warm starts made when --dtype float32 was the default stay cached."""
    return {**request, "policy": {k: v for k, v in request.get("policy", {}).items() if k != "dtype"}}


def main(argv: Optional[list[str]] = None) -> int:
    from lldslight.data.example import check_template, make_prompt
    from lldslight.data.formats import load_examples
    from lldslight.retrieval.bm25 import BM25Retriever
    from lldslight.retrieval.http import HttpRetriever
    from lldslight.retrieval.index import load_index

    parser = ArgumentParser(
        prog="lldslight sft",
        description="Supervised warm start on gold search trajectories; writes a HF model directory for model.policy.model.",
    )
    parser.add_argument("--data", action="append", required=True, help="question file(s): Search-R1 parquet, FlashRAG jsonl, ... (repeatable)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--corpus", help="corpus jsonl to search with BM25 (id, contents)")
    source.add_argument("--index", help="an index directory built by lldslight index")
    source.add_argument("--retriever-url", help="a Search-R1 /retrieve endpoint, e.g. http://127.0.0.1:8000/retrieve")
    parser.add_argument("--out", required=True, help="output model directory")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="demo model name, HF directory or hub id")
    parser.add_argument("--limit", type=int, default=None, help="use the first N examples")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--lora-r", type=int, default=16, help="LoRA rank (0 = train every weight)")
    parser.add_argument("--topk", type=int, default=3)
    parser.add_argument("--max-obs-tokens", type=int, default=500)
    parser.add_argument("--max-searches", type=int, default=4)
    parser.add_argument("--over-budget", choices=["skip", "truncate"], default="skip",
                        help="examples needing more than --max-searches searches: skip them, or keep their first searches and answer anyway")
    parser.add_argument("--keep-unanswerable", action="store_true", help="also train on examples whose answer was not retrieved")
    parser.add_argument("--random-init", type=json.loads, default=None, metavar="JSON",
                        help='build --model\'s architecture with these config changes and random weights (tests), e.g. \'{"num_hidden_layers": 2}\'')
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16-mixed", "bf16-true", "auto"],
                        help="the warm start's arithmetic, as policy.precision (docs/precision.md); fp32 by default, "
                             "so the weights it saves do not depend on the CPU")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "auto"], help="deprecated: use --precision")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt-template", default=None,
                        help="user prompt with one {question} (default: Search-R1's); must equal the fit config's data.prompt_template")
    parser.add_argument("--force", action="store_true", help="retrain even when OUT already holds this warm start; write into "
                        "an OUT that holds other files (files of the same name, e.g. config.json, are replaced)")
    args = parser.parse_args(argv)

    lora = LoRAConfig(r=args.lora_r, alpha=2 * args.lora_r) if args.lora_r > 0 else None
    precision = {"precision": args.precision} if args.dtype is None else {"dtype": args.dtype}  # --dtype warns, mapped
    policy = PolicyConfig(model=args.model, lora=lora, random_init=args.random_init, **precision)
    gold = GoldConfig(topk=args.topk, max_obs_tokens=args.max_obs_tokens, max_searches=args.max_searches,
                      over_budget=args.over_budget, require_answer_in_context=not args.keep_unanswerable)
    request = {"data": args.data, "corpus": args.corpus, "index": args.index, "retriever_url": args.retriever_url, "limit": args.limit,
               "epochs": args.epochs, "batch_size": args.batch_size, "lr": args.lr, "seed": args.seed,
               "policy": dataclasses.asdict(policy), "gold": dataclasses.asdict(gold)}
    if args.prompt_template is not None:  # absent from the request otherwise: earlier warm starts stay cached
        request["prompt_template"] = args.prompt_template
    # The files as well as their paths: a knowledge base re-synthesised in place (another seed, the
    # same out_dir) must not reuse the warm start trained on the old one. Size and mtime, not a
    # hash: a retrieval corpus can be many GB, and a rewrite always moves the mtime.
    request["inputs"] = {p: _stat_key(p) for p in [*args.data, args.corpus] if p}
    marker = Path(args.out) / "lldslight_export.json"
    try:
        earlier = json.loads(marker.read_text()) if marker.is_file() else None
    except (OSError, json.JSONDecodeError):
        earlier = None
    done = earlier.get("request") if isinstance(earlier, dict) else None
    if done is not None and not args.force and _cache_key(done) == _cache_key(request):
        print(f"[lldslight] sft: {args.out} already holds this warm start (--force to retrain)")
        return 0
    # Bad input (a missing or malformed file, an unreachable retriever, an unusable model, no usable
    # example) ends with one line naming it, as the other lldslight tools do, not a traceback.
    try:
        # Before anything loads: a directory of the user's is not overwritten without --force (an
        # earlier warm start of another request is lldslight's own, replaced), and it must be writable.
        if done is None:
            check_out_dir(Path(args.out), args.force, "--out", "the warm start")
        else:
            check_writable(Path(args.out).parent, "--out")
        examples = [ex for path in args.data for ex in load_examples(path)]
        if args.prompt_template is not None:
            check_template(args.prompt_template, "--prompt-template")
            for ex in examples:
                ex.messages = [{"role": "user", "content": make_prompt(ex.question, args.prompt_template)}]
        if args.limit is not None:
            examples = examples[: args.limit]
        if args.corpus:
            retriever = BM25Retriever(corpus=args.corpus)
        elif args.index:
            retriever = load_index(args.index)
        else:
            retriever = HttpRetriever(url=args.retriever_url)
        summary = warm_start(examples, retriever, args.out, policy, gold, args.epochs, args.batch_size, args.lr, args.seed,
                             meta={"request": request})
    except (UserError, FloatingPointError, ValueError) as e:  # DataFormatError, RetrievalError, PolicyLoadError, ...
        print(f"lldslight sft: error: {e}", file=sys.stderr)
        return 2
    return 0 if math.isfinite(summary["final_loss"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
