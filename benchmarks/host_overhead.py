"""Host overhead per decode step: lldslight's RolloutEngine vs ``model.generate``, with a 1-layer
model so small that the time is Python, dispatch and sampling, not FLOPs or weight traffic.

    python benchmarks/host_overhead.py --json host_overhead.json
    python benchmarks/host_overhead.py --lora          # LoRA on both (the engine folds it, generate does not)

A GPU proxy this CPU can measure: on a GPU the weights are fast and each step's launches and host
bookkeeping are what is left, so the ms per step here bounds what the engine's own loop costs
there. Same rows (``--prompts`` x G), same token count (generate is forced to ``--new-tokens`` with
min_new_tokens; the engine's rows rarely stop early on random weights, and its steps are counted
as its longest row), same sampling (temperature 1, no top-k/top-p). Both include one prompt
prefill. Runs alternate engine / generate (benchmarks/harness.py: load records, busy runs
repeated, medians with [min-max]).

The model: SmolLM2-135M's architecture with 1 layer, hidden 16 (3 MB of weights, nearly all the
49k-vocabulary projection, kept so that prompts and samples are real token ids).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

if __package__:  # benchmarks.host_overhead: imported (tests), or run as python -m benchmarks.host_overhead
    from . import harness
    from .step import PROMPTS
else:  # python benchmarks/host_overhead.py: the script's own folder is on sys.path
    import harness
    from step import PROMPTS

TINY = {"num_hidden_layers": 1, "hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 8}


def load(lora: bool):
    from lldslight.policy import LoRAConfig, PolicyConfig, load_policy

    model, tok = load_policy(PolicyConfig(dtype="float32", random_init=dict(TINY), lora=LoRAConfig(r=4, alpha=8) if lora else None,
                                          gradient_checkpointing=False))
    return model.eval(), tok


def examples_for(prompts: list[str]):
    from lldslight.data.example import QAExample

    return [QAExample(id=str(i), question=q, golden_answers=["-"], data_source="bench", messages=[{"role": "user", "content": q}], group_id=i)
            for i, q in enumerate(prompts)]


class NoSearch:
    def search(self, queries, k):
        return [[] for _ in queries]


def make_engine(tok, G: int, new_tokens: int):
    """Built once, as the SearchRollout callback does (its first call caches tokenizer tables)."""
    from lldslight.rollout import RolloutConfig, RolloutEngine

    cfg = RolloutConfig(group_size=G, max_turns=0, max_new_tokens=new_tokens, max_response_tokens=new_tokens, temperature=1.0)
    return RolloutEngine(tok, NoSearch(), lambda text, gold: 0.0, cfg)


def run_engine(engine, model, examples, G: int) -> dict:
    t0 = time.perf_counter()
    traj = engine.generate(model, examples, group_size=G)
    wall = time.perf_counter() - t0
    per_row = traj.loss_mask.sum(-1)
    steps = int(per_row.max())
    return {"wall_s": wall, "steps": steps, "tokens": int(per_row.sum()), "ms_per_step": wall / steps * 1e3}


def run_generate(model, tok, examples, G: int, new_tokens: int) -> dict:
    import torch

    from lldslight.rollout import prompt_token_ids

    prompts = [prompt_token_ids(tok, ex.messages) for ex in examples for _ in range(G)]
    width = max(len(p) for p in prompts)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=attn, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad)
    wall = time.perf_counter() - t0
    steps = out.shape[1] - width
    return {"wall_s": wall, "steps": steps, "tokens": steps * out.shape[0], "ms_per_step": wall / steps * 1e3}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--lora", action="store_true", help="LoRA r=4 on all linear layers, both sides")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    harness.add_arguments(p)
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model, tok = load(args.lora)
    examples = examples_for(PROMPTS[: args.prompts])
    G, n = args.group_size, args.new_tokens
    engine = make_engine(tok, G, n)
    runners = {"engine": lambda: run_engine(engine, model, examples, G), "generate": lambda: run_generate(model, tok, examples, G, n)}
    for fn in runners.values():
        fn()  # warm-up

    def run(side):
        with harness.LoadMeter() as m:
            figures = runners[side]()
        return figures, m.record

    policy = harness.policy_from_args(args)
    attempts = harness.alternate(list(runners), run, args.rounds, policy,
                                 describe=lambda side, m: f"{m['ms_per_step']:.2f} ms/step over {m['steps']} steps;")
    keys = ["ms_per_step", "wall_s", "steps", "tokens"]
    report = {
        "config": {"prompts": args.prompts, "group_size": G, "new_tokens": n, "threads": args.threads, "lora": args.lora, "model": TINY},
        "sides": {s: harness.side_summary(attempts, s, keys) for s in runners},
        "ratio": harness.ratio_summary(attempts, "engine", "generate", "ms_per_step"),
        "quiet": harness.quiet_summary(attempts, policy),
        "attempts": [a.to_dict() for a in attempts],
    }
    eng, gen = (report["sides"][s]["ms_per_step"] for s in ("engine", "generate"))
    report["engine_minus_generate_ms"] = eng["median"] - gen["median"]
    print(f"\nHost overhead per decode step: 1-layer model{' + LoRA' if args.lora else ''}, {args.prompts} prompts x G={G} = "
          f"{args.prompts * G} rows, {n} new tokens, {args.threads} thread(s); medians [min-max] of {args.rounds} alternating rounds")
    print(f"  RolloutEngine.generate  {harness.fmt_spread(eng)} ms/step")
    print(f"  model.generate          {harness.fmt_spread(gen)} ms/step")
    r = report["ratio"]
    print(f"  engine / generate       {r['ratio_of_medians']:.2f} (per round {r['spread']['min']:.2f}-{r['spread']['max']:.2f}); "
          f"difference {report['engine_minus_generate_ms']:+.2f} ms/step")
    print(harness.quiet_line(report["quiet"]))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
