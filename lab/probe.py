"""How much GRPO signal a policy offers: sampled success rates per question type, the share of
groups with mixed rewards, format validity and entropy-like numbers; greedy dev EM per type.

    python lab/probe.py runs/lab/policy [--config lab/configs/base.yaml] [--n 64] [--group-size G]

A warm start fit for the lab leaves many groups mixed (some right, some wrong answers) on the
question types where right and wrong trajectories share their first search.
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path

from lldslight.errors import script_main

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    import torch
    import yaml

    from lldslight.data.formats import load_examples
    from lldslight.policy import PolicyConfig, load_policy
    from lldslight.retrieval.bm25 import BM25Retriever
    from lldslight.rewards import ExactMatchReward
    from lldslight.rollout import RolloutConfig, RolloutEngine

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--config", default="lab/configs/base.yaml")
    parser.add_argument("--n", type=int, default=64, help="training questions sampled (the first N)")
    parser.add_argument("--group-size", type=int, default=None, help="rollouts per question (default: the config's rollout.group_size)")
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--dev", type=int, default=48)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    config = yaml.safe_load((ROOT / args.config).read_text())
    cb = next(c["init_args"] for c in config["trainer"]["callbacks"] if c["class_path"].endswith("SearchRollout"))
    kb = Path(config["data"]["synthesize"]["out_dir"])
    rc = dict(cb["rollout"])
    if args.temperature is not None:
        rc["temperature"] = args.temperature
    if args.group_size is not None:
        rc["group_size"] = args.group_size
    model, tok = load_policy(PolicyConfig(model=args.model, dtype="float32", lora=None, gradient_checkpointing=False))
    retriever = BM25Retriever(corpus=cb["retriever"]["init_args"]["corpus"], show_progress=False)
    engine = RolloutEngine(tok, retriever, ExactMatchReward(), RolloutConfig(**rc))
    train = load_examples(kb / "train.jsonl")[: args.n]
    for i, ex in enumerate(train):
        ex.group_id = i
    t0 = time.perf_counter()
    per_type = defaultdict(list)
    mixed = defaultdict(int)
    valid, searches, lengths, logps = [], [], [], []
    for start in range(0, len(train), 4):
        batch = train[start : start + 4]
        traj = engine.generate(model, batch)
        G = rc["group_size"]
        for j, ex in enumerate(batch):
            r = traj.reward[j * G : (j + 1) * G]
            per_type[ex.meta["type"]].append(float(r.mean()))
            mixed[ex.meta["type"]] += int(bool((r > 0).any() and (r == 0).any()))
        valid += [f == "answer" for f in traj.finish_reason]
        searches += traj.num_searches.tolist()
        lengths += traj.response_len.tolist()
        m = traj.loss_mask
        logps.append(float(traj.sample_logp[m].mean()))
    dt = time.perf_counter() - t0
    print(f"sampled T={rc['temperature']} G={rc['group_size']} on {len(train)} train questions ({dt:.1f} s):")
    for t, rs in sorted(per_type.items()):
        print(f"  {t:10s} n={len(rs):3d}  success {sum(rs) / len(rs):.3f}  mixed groups {mixed[t] / len(rs):.2f}")
    allr = [x for rs in per_type.values() for x in rs]
    print(f"  all        success {sum(allr) / len(allr):.3f}  mixed {sum(mixed.values()) / len(allr):.2f}  answered {sum(valid) / len(valid):.2f}"
          f"  searches {sum(searches) / len(searches):.2f}  model tokens {sum(lengths) / len(lengths):.1f}  mean logp {sum(logps) / len(logps):.3f}")
    dev = load_examples(kb / "dev.jsonl")[: args.dev]
    for i, ex in enumerate(dev):
        ex.group_id = i
    traj = engine.generate(model, dev, group_size=1, greedy=True)
    by = defaultdict(list)
    for ex, em in zip(dev, traj.em.tolist()):
        by[ex.meta["type"]].append(em)
    print("greedy dev EM: " + "  ".join(f"{t} {sum(v) / len(v):.3f}" for t, v in sorted(by.items())) + f"  all {float(traj.em.mean()):.3f}")
    for k in range(3):
        print("  e.g.", repr(traj.responses[k][-160:]), dev[k].golden_answers)
    return 0


if __name__ == "__main__":
    raise SystemExit(script_main(main))
