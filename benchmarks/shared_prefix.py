"""A group's shared prompt encoded once (``model.update.shared_prefix``) against every row in full,
by prompt length: where the sharing pays and where it costs.

    python benchmarks/shared_prefix.py --json benchmarks/results/shared_prefix_<cpu>.json
    python benchmarks/shared_prefix.py --prompt-tokens 16 64 --rounds 1 --repeats 1   # a smoke run

The update's two kinds of pass, timed on their own: a forward without gradient (pi_old's and the
reference's log-probs) and a forward and backward (a training micro-batch), through
``lldslight.update.logprobs.token_logprobs`` with ``groups`` (shared) and without (plain). The model
is SmolLM2-135M-Instruct (the bundled demo model) with LoRA r=16 on every linear layer and gradient
checkpointing, as benchmarks/step.py's single-turn step trains it. The batch: ``--groups`` groups of
``--group-size`` rows; each group's prompt is ``P`` random token ids (P from ``--prompt-tokens``),
each row's own response ``--response-tokens`` ids, in two layouts (``--layouts``): "spread", rows'
lengths spread from half that to all of it (right-padded, as rollouts are: the packed layout also
drops the padding), and "equal", every row that long (no padding: what the sharing alone saves). Sides alternate, shared then plain, ``--rounds`` rounds of
``--repeats`` passes each (benchmarks/harness.py: load recorded, busy runs repeated); medians.

Reported per P: the tokens each side runs (plain: rows x longest row; shared: the packed count),
shared / plain time of each pass, and the largest log-prob difference between the sides (they
compute the same values; tests/test_shared_prefix.py holds them to fp32 rounding). The break-even
(per layout) is the shortest P from which every longer P in the sweep was faster shared, in both
passes. The JSON
holds every figure, the CPU model, its SIMD flags and the load.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

try:
    from . import harness
except ImportError:  # run as a script: benchmarks/ is on sys.path
    import harness


def batch(P: int, groups: int, G: int, R: int, layout: str, vocab: int, generator):
    """(input_ids [B, T], attention_mask [B, T], mask [B, T], group ids [B]) for one sweep point;
    ``layout`` "spread": responses of R/2 .. R tokens (padding, which the packed layout drops too),
    "equal": every response R tokens (no padding: the sharing alone)."""
    import torch

    B = groups * G
    if layout == "equal":
        lengths = [P + R] * B
    else:
        lengths = [P + R // 2 + (R - R // 2) * (b % G) // max(G - 1, 1) for b in range(B)]  # R/2 .. R response tokens
    T = max(lengths)
    ids = torch.zeros(B, T, dtype=torch.long)
    attn = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.bool)
    prompts = torch.randint(100, vocab - 100, (groups, P), generator=generator)
    for b, n in enumerate(lengths):
        ids[b, :P] = prompts[b // G]
        ids[b, P:n] = torch.randint(100, vocab - 100, (n - P,), generator=generator)
        attn[b, :n] = 1
        mask[b, P:n] = True
    return ids, attn, mask, torch.arange(B) // G


def break_even_at(points: list[dict]):
    """The shortest prompt length from which every longer one in ``points`` (ascending) ran faster
    shared than plain in both passes; None when the longest did not."""
    faster = [all(pt["ratios"][k]["ratio_of_medians"] < 1 for k in ("forward", "train")) for pt in points]
    return next((points[i]["prompt_tokens"] for i in range(len(points)) if all(faster[i:])), None)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256])
    p.add_argument("--response-tokens", type=int, default=64)
    p.add_argument("--layouts", nargs="+", default=["equal", "spread"], choices=["equal", "spread"])
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16-mixed"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3, help="passes per timed run (the run's time is their mean)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.add_argument("--tiny", action="store_true", help="a 2-layer random-initialised model of SmolLM2's kind (a smoke run, not a figure)")
    harness.add_arguments(p)
    args = p.parse_args(argv)
    if min(args.prompt_tokens) < 1 or args.response_tokens < 2 or args.groups < 1 or args.group_size < 2:
        raise SystemExit("shared_prefix: --prompt-tokens >= 1, --response-tokens >= 2, --groups >= 1 and --group-size >= 2")
    import torch

    from lldslight.policy import LoRAConfig, PolicyConfig, cpu_description, load_policy
    from lldslight.update import shared_prefix
    from lldslight.update.logprobs import token_logprobs

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tiny = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}
    model, _ = load_policy(PolicyConfig(precision=args.precision, lora=LoRAConfig(r=16, alpha=32), gradient_checkpointing=True,
                                        random_init=tiny if args.tiny else None))
    model.train()
    if not shared_prefix.supported(model):
        raise SystemExit("shared_prefix: this model's attention cannot run split (see shared_prefix.supported)")
    generator = torch.Generator().manual_seed(args.seed)
    policy = harness.policy_from_args(args)
    points = []
    for lay, P in [(lay, P) for lay in args.layouts for P in args.prompt_tokens]:
        ids, attn, mask, groups = batch(P, args.groups, args.group_size, args.response_tokens, lay, model.config.vocab_size, generator)
        layout = shared_prefix.pack_groups(ids, attn, groups)
        tokens = {"plain": ids.numel(), "shared": int(layout.input_ids.shape[1]) if layout is not None else ids.numel()}

        def one(side: str, kind: str):
            g = groups if side == "shared" else None
            if kind == "forward":
                with torch.no_grad():
                    return token_logprobs(model, ids, attn, mask, groups=g)[0]
            model.zero_grad(set_to_none=True)
            logp = token_logprobs(model, ids, attn, mask, groups=g)[0]
            logp.sum().backward()
            return logp.detach()

        diff = max(float((one("shared", k) - one("plain", k)).abs().max()) for k in ("forward", "train"))  # also the warm-up

        def run(side_kind: str):
            side, kind = side_kind.split("/")
            with harness.LoadMeter() as m:
                t0 = time.perf_counter()
                for _ in range(args.repeats):
                    one(side, kind)
                wall = (time.perf_counter() - t0) / args.repeats
            return {"ms": wall * 1e3}, m.record

        sides = ["shared/forward", "plain/forward", "shared/train", "plain/train"]
        attempts = harness.alternate(sides, run, args.rounds, policy, describe=lambda s, m: f"{lay} P={P} {m['ms']:.0f} ms;")
        point = {"layout": lay, "prompt_tokens": P, "rows": int(ids.shape[0]), "tokens": tokens, "max_abs_logp_difference": diff,
                 "sides": {s: harness.side_summary(attempts, s, ["ms"]) for s in sides},
                 "ratios": {k: harness.ratio_summary(attempts, f"shared/{k}", f"plain/{k}", "ms") for k in ("forward", "train")},
                 "quiet": harness.quiet_summary(attempts, policy)}
        points.append(point)
    break_even = {lay: break_even_at([pt for pt in points if pt["layout"] == lay]) for lay in args.layouts}
    cpu = cpu_description()
    report = {"config": {k: getattr(args, k) for k in ("prompt_tokens", "layouts", "response_tokens", "groups", "group_size", "precision",
                                                        "threads", "rounds", "repeats", "seed", "tiny")},
              "cpu": cpu, "points": points, "break_even_prompt_tokens": break_even}
    print(f"\nShared prefix vs plain rows, by prompt length: SmolLM2-135M-Instruct + LoRA r=16 (all linear), gradient "
          f"checkpointing, {args.precision}, {args.threads} thread(s); {args.groups} groups x G={args.group_size}, "
          f"{args.response_tokens // 2}-{args.response_tokens} response tokens; {cpu['cpu_model']} (SIMD: "
          f"{', '.join(cpu['cpu_flags_simd'])}); medians of {args.rounds} alternating rounds of {args.repeats} passes")
    print("| layout | prompt tokens | tokens plain / shared | forward plain (ms) | forward shared / plain | train plain (ms) | "
          "train shared / plain | largest log-prob difference | load average at start | quiet |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for pt in points:
        s, r = pt["sides"], pt["ratios"]
        print(f"| {pt['layout']} | {pt['prompt_tokens']} | {pt['tokens']['plain']} / {pt['tokens']['shared']} | "
              f"{harness.fmt_spread(s['plain/forward']['ms'], '{:.0f}')} | {r['forward']['ratio_of_medians']:.2f} | "
              f"{harness.fmt_spread(s['plain/train']['ms'], '{:.0f}')} | {r['train']['ratio_of_medians']:.2f} | "
              f"{pt['max_abs_logp_difference']:.2g} | {pt['quiet']['loadavg_start_max']:.2f} | "
              f"{'yes' if pt['quiet']['quiet'] else 'NO: do not quote'} |")
    for lay, be in break_even.items():
        print(f"break-even, {lay}: {'from ' + str(be) + ' prompt tokens' if be is not None else 'none in this sweep'} (shared "
              f"faster in both passes at that length and every longer one); median shared / plain train ratio "
              f"{statistics.median(pt['ratios']['train']['ratio_of_medians'] for pt in points if pt['layout'] == lay):.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
