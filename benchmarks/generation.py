"""Multi-turn search rollouts vs plain ``model.generate`` making the same number of new tokens.

    python benchmarks/generation.py                    # SmolLM2-135M-Instruct fp32, BM25, synthetic KB
    python benchmarks/generation.py --json rollout.json --repeats 3
    python benchmarks/generation.py --baseline-rollout OLD/lldslight/rollout   # A/B two engines

The engine runs the Search-R1 protocol (up to ``--max-turns`` searches, then an answer) on
``--prompts`` questions x G; every model token it samples is counted. ``model.generate`` then
samples exactly as many new tokens per row (min_new_tokens = max_new_tokens) for the same prompts
x G, with one forward per token, no retrieval and no observations. Runs alternate engine /
generate (benchmarks/harness.py: load recorded around every run, busy runs repeated, medians with
their spread, a quiet/NOT QUIET verdict) and medians are reported: tokens per second for both, and where the engine's time goes
(prompt prefill, decoding, observation prefill, retrieval).

Three of the engine's choices are measured directly:
- prefill once per group: the same rollouts with each prompt repeated G times and G=1 (no
  sharing) vs G rollouts sharing one prefilled prompt;
- KV cache carried across turns: the observation prefill the engine pays vs re-encoding the whole
  context at every turn boundary (timed as full forwards over the contexts at those boundaries);
- the sampler: inverse-CDF sampling with one uniform per row vs log-softmax + torch.multinomial
  (what the engine did before), on [rows, vocabulary] logits, alternating, medians.
``--baseline-rollout`` A/Bs a whole other engine (e.g. the turn-synchronous one of an older
commit) in the same process, alternating with this one: an older checkout's ``lldslight/rollout/``
package (its folder) or, from before the package, its single ``lldslight/rollout.py``. Every run records the load average
before and after it: on a shared machine only ratios of interleaved runs mean anything.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

if __package__:  # benchmarks.generation: imported, or run as python -m benchmarks.generation
    from . import harness
else:  # python benchmarks/generation.py: the script's own folder is on sys.path
    import harness


def load_engine_module(path: str | None):
    if path is None:
        import lldslight.rollout as mod

        return mod
    path = Path(path)
    if path.name == "__init__.py":
        path = path.parent
    if path.is_dir():  # a rollout/ package: its modules import each other relatively, so they load from it
        spec = importlib.util.spec_from_file_location("baseline_rollout", path / "__init__.py", submodule_search_locations=[str(path)])
    else:  # one file: lldslight/rollout.py from before the package
        spec = importlib.util.spec_from_file_location("baseline_rollout", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["baseline_rollout"] = mod
    spec.loader.exec_module(mod)
    return mod


def examples_and_retriever(n: int, work: Path):
    from lldslight.data.formats import load_examples
    from lldslight.data.synth import synthesize
    from lldslight.retrieval import BM25Retriever

    kb = synthesize(work, seed=0, entities=200, dev=max(n, 8), test=8)
    examples = load_examples(kb["dev_jsonl"] if "dev_jsonl" in kb else kb["train_jsonl"])[:n]
    for gid, ex in enumerate(examples):
        ex.group_id = gid
    return examples, BM25Retriever(corpus=str(kb["corpus"]), show_progress=False)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_engine(mod, model, tok, retriever, examples, cfg_kw, G, stop_every: int = 0):
    engine = mod.RolloutEngine(tok, retriever, lambda text, gold: 0.0, mod.RolloutConfig(**cfg_kw))
    if stop_every:  # turns end at scattered steps, as a policy that searches and answers ends them
        engine.eos_ids = sorted(set(engine.eos_ids) | set(range(0, len(tok), stop_every)))
    device = next(model.parameters()).device
    sync(device)
    load = os.getloadavg()[0]
    t0, c0 = time.perf_counter(), time.process_time()
    traj = engine.generate(model, examples, group_size=G)
    sync(device)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = int(traj.loss_mask.sum())
    stats = {k: float(v) for k, v in engine.stats.items()}
    return {"wall_s": wall, "cpu_s": cpu, "tokens": tokens, "tok_per_s": tokens / wall, "cpu_tok_per_s": tokens / cpu,
            "load_before": load, "load_after": os.getloadavg()[0], **stats}, traj


def sampler_ab(tok, rows: int, repeats: int, device) -> dict:
    """Median seconds per call: the engine's inverse-CDF sampler vs log-softmax + multinomial."""
    from lldslight.rollout import RolloutConfig, RolloutEngine

    vocab = len(tok)
    engine = RolloutEngine(tok, None, lambda text, gold: 0.0, RolloutConfig())
    logits = torch.randn(rows, vocab, device=device) * 3

    def old():
        logp = torch.log_softmax(logits, -1)
        tokens = torch.multinomial(logp.exp(), 1)[:, 0]
        return tokens, logp.gather(-1, tokens[:, None])[:, 0]

    def new():
        return engine.sample(logits, torch.rand(rows, dtype=torch.float64, device=device))

    times = {"multinomial": [], "inverse_cdf": []}
    for _ in range(repeats):
        for name, fn in (("multinomial", old), ("inverse_cdf", new)):
            sync(device)
            t0 = time.perf_counter()
            fn()[0].tolist()
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"rows": rows, "vocab": vocab, "multinomial_s": med["multinomial"], "inverse_cdf_s": med["inverse_cdf"], "ratio": med["inverse_cdf"] / med["multinomial"]}


def run_generate(model, tok, examples, G, new_tokens, temperature):
    from lldslight.rollout import prompt_token_ids

    device = next(model.parameters()).device
    prompts = [prompt_token_ids(tok, ex.messages) for ex in examples for _ in range(G)]
    width = max(len(p) for p in prompts)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    sync(device)
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=attn, do_sample=True, temperature=temperature, top_p=1.0, top_k=0,
            max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad,
        )
    sync(device)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = (out.shape[1] - width) * out.shape[0]
    return {"wall_s": wall, "cpu_s": cpu, "tokens": tokens, "tok_per_s": tokens / wall, "cpu_tok_per_s": tokens / cpu}


def reencode_cost(model, traj, turns: int) -> float:
    """Seconds to re-encode each rollout's whole context at every turn boundary, without a cache
    (what carrying the KV cache across turns avoids): one full forward per boundary, over the
    context up to the end of that turn's observation."""
    from lldslight.policy import decoder_and_head

    decoder, _ = decoder_and_head(model)
    device = traj.input_ids.device
    obs_ends = []
    for b in range(len(traj)):
        obs = (traj.action_id[b] == -1) & traj.attention_mask[b].bool()
        obs[: int(traj.prompt_len[b])] = False
        nxt = torch.cat([obs[1:], obs.new_zeros(1)])
        obs_ends.append(((obs & ~nxt).nonzero()[:, 0] + 1).tolist())  # end (exclusive) of each observation
    total = 0.0
    for boundary in range(turns):
        rows = [b for b in range(len(traj)) if len(obs_ends[b]) > boundary]
        if not rows:
            break
        width = max(obs_ends[b][boundary] for b in rows)
        # right-padded rows: each row's context is its first obs_ends[b][boundary] tokens (padding
        # beyond that only costs the re-encode more, so this under-states what is avoided)
        ids = traj.input_ids[rows, :width]
        attn = traj.attention_mask[rows, :width].clone()
        for i, b in enumerate(rows):
            attn[i, obs_ends[b][boundary]:] = 0
        sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            decoder(input_ids=ids, attention_mask=attn, use_cache=False)
        sync(device)
        total += time.perf_counter() - t0
    return total


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-turns", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=48, help="per turn")
    p.add_argument("--max-obs-tokens", type=int, default=160)
    p.add_argument("--max-response-tokens", type=int, default=400)
    p.add_argument("--repeats", type=int, default=3, help="alternating engine / generate runs (after a warm-up)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--random-init", default=None, help="JSON config overrides: a random model of that shape instead of the demo weights")
    p.add_argument("--baseline-rollout", default=None, help="another engine to A/B against this one: a lldslight/rollout/ folder, or an older single rollout.py")
    p.add_argument("--skip-sharing", action="store_true", help="skip the prefill-sharing A/B")
    p.add_argument("--stop-every", type=int, default=0,
                   help="also end a turn at every N-th token id: rows end turns at scattered steps, as a searching policy's do "
                        "(the demo model never writes a tag, so without it every row runs each turn to its budget in lockstep)")
    p.add_argument("--json", default=None)
    p.add_argument("--seed", type=int, default=0)
    harness.add_arguments(p)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from lldslight.policy import PolicyConfig, load_policy

    pcfg = PolicyConfig(dtype="auto", lora=None, gradient_checkpointing=False)
    if args.random_init:
        pcfg.random_init = json.loads(args.random_init)
    model, tok = load_policy(pcfg)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device).eval()
    work = Path(tempfile.mkdtemp(prefix="lldslight_rollout_bench_"))
    examples, retriever = examples_and_retriever(args.prompts, work)
    G = args.group_size
    cfg_kw = dict(
        group_size=G, max_turns=args.max_turns, max_new_tokens=args.max_new_tokens, max_obs_tokens=args.max_obs_tokens,
        max_response_tokens=args.max_response_tokens, topk=2, temperature=1.0,
    )
    engines = {"engine": load_engine_module(None)}
    if args.baseline_rollout:
        engines["baseline"] = load_engine_module(args.baseline_rollout)

    torch.manual_seed(args.seed)
    run_engine(engines["engine"], model, tok, retriever, examples, cfg_kw, G, args.stop_every)  # warm-up
    results: dict[str, list[dict]] = {k: [] for k in list(engines) + ["generate", "unshared", "reencode"]}
    policy = harness.policy_from_args(args)
    attempts: list[harness.Attempt] = []
    if args.repeats < harness.MIN_ROUNDS:
        print(f"[rollout] {args.repeats} repeat(s): fewer than {harness.MIN_ROUNDS}, a smoke test, not a result", flush=True)

    def timed(side: str, rep: int, fn, seed: int):
        """fn() under the harness: load recorded, repeated while busy; the kept run's value."""
        def run():
            torch.manual_seed(seed)
            return harness.metered(fn)

        tries = harness.until_quiet(run, policy, lambda s: print(s, flush=True), f"repeat {rep + 1}/{args.repeats} {side}")
        for k, (value, load, busy) in enumerate(tries):
            res = value[0] if isinstance(value, tuple) else value
            attempts.append(harness.Attempt(side, rep, k, {x: y for x, y in res.items() if x != "load"}, load, busy, kept=k == len(tries) - 1))
        value, load, busy = tries[-1]
        (value[0] if isinstance(value, tuple) else value).update(load=load.to_dict(), busy=busy)
        return value

    for rep in range(args.repeats):
        seed = args.seed + rep
        res, traj = timed("engine", rep, lambda: run_engine(engines["engine"], model, tok, retriever, examples, cfg_kw, G, args.stop_every), seed)
        results["engine"].append(res)
        per_row = max(1, round(res["tokens"] / len(traj)))
        results["generate"].append(timed("generate", rep, lambda: run_generate(model, tok, examples, G, per_row, 1.0), seed))
        results["reencode"].append(timed("reencode", rep, lambda: {"wall_s": reencode_cost(model, traj, args.max_turns)}, seed))
        if "baseline" in engines:
            results["baseline"].append(timed("baseline", rep, lambda: run_engine(engines["baseline"], model, tok, retriever, examples, cfg_kw, G, args.stop_every)[0], seed))
        if not args.skip_sharing:
            repeated = [ex for ex in examples for _ in range(G)]
            results["unshared"].append(timed("unshared", rep, lambda: run_engine(engines["engine"], model, tok, retriever, repeated, dict(cfg_kw, group_size=1), 1, args.stop_every)[0], seed))
        print(f"[rollout] repeat {rep + 1}/{args.repeats}: engine {res['tok_per_s']:.1f} tok/s, generate {results['generate'][-1]['tok_per_s']:.1f} tok/s", flush=True)

    med = lambda runs, key: statistics.median(r[key] for r in runs) if runs and key in runs[0] else float("nan")  # noqa: E731
    eng, gen = results["engine"], results["generate"]
    report = {
        "config": {**cfg_kw, "prompts": args.prompts, "threads": args.threads, "device": str(device), "model": "random-init" if args.random_init else "smollm2-135m-instruct"},
        "engine_tok_per_s": med(eng, "tok_per_s"),
        "generate_tok_per_s": med(gen, "tok_per_s"),
        "tokens": med(eng, "tokens"),
        "engine_wall_s": med(eng, "wall_s"),
        "generate_wall_s": med(gen, "wall_s"),
        "prefill_s": med(eng, "prefill_s"),
        "decode_s": med(eng, "decode_s"),
        "observation_s": med(eng, "observation_s"),
        "retrieval_s": med(eng, "retrieval_s"),
        "retrieval_calls": med(eng, "retrieval_calls"),
        "decode_steps": med(eng, "decode_steps"),
        "compactions": med(eng, "compactions"),
        "overlap_steps": med(eng, "overlap_steps"),
        "retrieval_wait_s": med(eng, "retrieval_wait_s"),
        "load_avg": [min(r["load_before"] for r in eng), max(r["load_after"] for r in eng)],
        "reencode_s": med(results["reencode"], "wall_s"),
        "runs": results,
    }
    report["tok_per_s_ratio"] = report["engine_tok_per_s"] / report["generate_tok_per_s"]
    report["spread"] = {s: harness.side_summary(attempts, s, ["tok_per_s", "wall_s"]) for s in ("engine", "generate")}
    report["tok_per_s_ratio_rounds"] = harness.ratio_summary(attempts, "engine", "generate", "tok_per_s")
    report["quiet"] = harness.quiet_summary(attempts, policy)
    report["engine_over_generate"] = statistics.median(e["tok_per_s"] / g["tok_per_s"] for e, g in zip(eng, gen))  # side-by-side pairs
    # CPU seconds of this process: less inflated than wall time by other processes on a shared machine
    report["engine_over_generate_cpu"] = statistics.median(e["cpu_tok_per_s"] / g["cpu_tok_per_s"] for e, g in zip(eng, gen))
    report["sampler"] = sampler_ab(tok, len(examples) * G, 50, device)
    if results["unshared"]:
        report["unshared_prefill_s"] = med(results["unshared"], "prefill_s")
        report["unshared_tok_per_s"] = med(results["unshared"], "tok_per_s")
    if results.get("baseline"):
        report["baseline_tok_per_s"] = med(results["baseline"], "tok_per_s")
        report["baseline_wall_s"] = med(results["baseline"], "wall_s")
        # per repeat, engine / baseline of the two runs taken side by side: robust to slow drifts in load
        pairs = [e["tok_per_s"] / b["tok_per_s"] for e, b in zip(eng, results["baseline"])]
        report["engine_over_baseline"] = statistics.median(pairs)
        report["engine_over_baseline_runs"] = pairs
        report["engine_over_baseline_cpu"] = statistics.median(e["cpu_tok_per_s"] / b["cpu_tok_per_s"] for e, b in zip(eng, results["baseline"]))

    print()
    print(
        f"Rollouts: {report['config']['model']} on {device}, {args.prompts} prompts x G={G}, up to {args.max_turns} searches, "
        f"{args.max_new_tokens} new tokens/turn, BM25 top-2; medians of {args.repeats} alternating runs, {args.threads} threads"
    )
    rows = [
        ("model tokens per run", f"{report['tokens']:.0f}", f"{report['tokens']:.0f}"),
        ("wall time (s)", f"{report['engine_wall_s']:.2f}", f"{report['generate_wall_s']:.2f}"),
        ("tokens / s", f"{report['engine_tok_per_s']:.1f}", f"{report['generate_tok_per_s']:.1f}"),
        ("  prompt prefill (s)", f"{report['prefill_s']:.2f}", "-"),
        ("  decoding (s)", f"{report['decode_s']:.2f}", "-"),
        ("  observation prefill (s)", f"{report['observation_s']:.2f}", "-"),
        ("  retrieval (s)", f"{report['retrieval_s']:.3f}", "-"),
    ]
    print(f"| {'':28} | {'multi-turn engine':>18} | {'model.generate':>15} |")
    print(f"|{'-' * 30}|{'-' * 20}|{'-' * 17}|")
    for label, a, b in rows:
        print(f"| {label:28} | {a:>18} | {b:>15} |")
    r = report["tok_per_s_ratio_rounds"]["spread"]
    print(f"tokens/s ratio (engine / generate): {report['tok_per_s_ratio']:.2f} (per round {r['min']:.2f}-{r['max']:.2f}; "
          f"per CPU second: {report['engine_over_generate_cpu']:.2f}); tok/s "
          f"engine {harness.fmt_spread(report['spread']['engine']['tok_per_s'], '{:.1f}')}, "
          f"generate {harness.fmt_spread(report['spread']['generate']['tok_per_s'], '{:.1f}')}")
    if "unshared_prefill_s" in report:
        print(f"prefill once per group: {report['prefill_s']:.2f} s vs {report['unshared_prefill_s']:.2f} s unshared (G={G}); "
              f"whole rollout {report['engine_tok_per_s']:.1f} vs {report['unshared_tok_per_s']:.1f} tok/s")
    print(f"KV cache across turns: observation prefill {report['observation_s']:.2f} s vs {report['reencode_s']:.2f} s re-encoding contexts")
    sam = report["sampler"]
    print(f"sampler ({sam['rows']} x {sam['vocab']}): inverse CDF {1e3 * sam['inverse_cdf_s']:.2f} ms vs multinomial {1e3 * sam['multinomial_s']:.2f} ms ({sam['ratio']:.2f}x)")
    print(f"load average over the engine runs: {report['load_avg'][0]:.1f} .. {report['load_avg'][1]:.1f}")
    if "baseline_tok_per_s" in report:
        print(f"baseline engine ({args.baseline_rollout}): {report['baseline_tok_per_s']:.1f} tok/s, {report['baseline_wall_s']:.2f} s; "
              f"engine / baseline, median of side-by-side pairs: {report['engine_over_baseline']:.2f}x (per CPU second: {report['engine_over_baseline_cpu']:.2f}x)")
    print(harness.quiet_line(report["quiet"]))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
