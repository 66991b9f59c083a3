"""One GRPO step, lldslight vs TRL's GRPOTrainer, on identical single-turn work.

    python benchmarks/step.py                      # installs TRL into benchmarks/.venv-trl once
    python benchmarks/step.py --json step.json --rounds 3 --steps 2

Both sides: SmolLM2-135M-Instruct in fp32 (the de-quantised cache dir lldslight makes from the
bundled GGUF; TRL loads it by path), the same prompts, G, max new tokens, sampling settings
(temperature 1, no top-p/top-k), LoRA r=16 on all linear layers, gradient checkpointing, the
"grpo" aggregation (seq-mean-token-mean), one optimiser update per step, the same micro-batch
size, the same reward function. No search: lldslight's RolloutEngine runs with max_turns=0 (the
final generation only), so TRL can do the same work. Each side runs in its own subprocess (its
own peak RSS); runs alternate A B A B and every run does a warm-up step that is not counted.

Reported per side: median step wall time split into generation / log-probs / update, generated
tokens per second, peak RSS, and lldslight / TRL ratios. Timings are noisy on a shared machine:
quote medians of alternating runs, never a single step.
"""
from __future__ import annotations

import argparse
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
TRL_VENV = HERE / ".venv-trl"
TRL_VERSION = "1.16.0"
TORCH_WHEEL_GLOB = "torch-2.13.0+cpu-*.whl"

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


# -- workers -------------------------------------------------------------------------------------


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _current_rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def worker_lldslight(spec: dict) -> dict:
    import torch

    torch.set_num_threads(spec["threads"])
    import lightning.pytorch as pl

    from lldslight.callbacks import SearchRollout
    from lldslight.data.example import QAExample
    from lldslight.module import GRPOModule
    from lldslight.policy import LoRAConfig, PolicyConfig
    from lldslight.rollout import RolloutConfig

    class NoSearch:
        def search(self, queries, k):
            return [[] for _ in queries]

    examples = [
        QAExample(id=str(i), question=q, golden_answers=["-"], data_source="bench", messages=[{"role": "user", "content": q}], group_id=i)
        for i, q in enumerate(spec["prompts"])
    ]

    class Prompts(torch.utils.data.IterableDataset):
        def __iter__(self):
            while True:
                yield examples

    class Data(pl.LightningDataModule):
        def train_dataloader(self):
            return torch.utils.data.DataLoader(Prompts(), batch_size=None)

    records: list[dict] = []

    class Timer(pl.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            total = time.perf_counter() - self.t0
            m = module.last_step_metrics
            rows = len(examples) * spec["group_size"]
            records.append(
                {
                    "step_s": total,
                    "generation_s": module.timings.get("rollout_s", float("nan")),
                    "logprob_s": module.timings.get("logprob_s", float("nan")),
                    "update_s": module.timings.get("update_s", float("nan")),
                    "tokens": m["train/response_len"] * rows,
                    "rss_mb": _rss_mb(),
                }
            )

    module = GRPOModule(
        policy=PolicyConfig(
            model=spec["model_dir"],
            dtype="float32",
            lora=LoRAConfig(r=spec["lora_r"], alpha=2 * spec["lora_r"]),
            gradient_checkpointing=True,
        ),
        lr=1e-5,
        updates_per_rollout=1,
        micro_batch_size=spec["micro_batch"],
        **({"micro_batch_tokens": spec["micro_batch_tokens"]} if spec.get("micro_batch_tokens") else {}),
        **({"logprob_chunk_size": spec["logprob_chunk_size"]} if spec.get("logprob_chunk_size") else {}),
        kl_coef=spec["beta"],
        aggregation="seq-mean-token-mean",
        grad_clip=1.0,
    )
    rollout = RolloutConfig(
        group_size=spec["group_size"],
        max_turns=0,
        max_new_tokens=spec["max_new_tokens"],
        max_response_tokens=spec["max_new_tokens"],
        temperature=1.0,
    )
    callbacks = [Timer(), SearchRollout(retriever=NoSearch(), reward=lambda text, gold: reward(text), rollout=rollout)]
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=spec["warmup"] + spec["steps"],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    pl.seed_everything(spec["seed"], verbose=False)
    trainer.fit(module, datamodule=Data())
    return {"steps": records[spec["warmup"] :], "peak_rss_mb": _rss_mb()}


def worker_trl(spec: dict) -> dict:
    import torch

    torch.set_num_threads(spec["threads"])
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    records: list[dict] = []
    clock = {"gen": 0.0, "score": 0.0, "tokens": 0}

    class TimedGRPO(GRPOTrainer):
        def _generate_single_turn(self, *args, **kwargs):
            t0 = time.perf_counter()
            completion_ids, logprobs = super()._generate_single_turn(*args, **kwargs)
            clock["gen"] += time.perf_counter() - t0
            clock["tokens"] += sum(len(c) for c in completion_ids)
            return completion_ids, logprobs

        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            clock["score"] += time.perf_counter() - t0
            return out

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            clock.update(gen=0.0, score=0.0, tokens=0)
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            total = time.perf_counter() - self.t0
            records.append(
                {
                    "step_s": total,
                    "generation_s": clock["gen"],
                    # generate_and_score = generation + reference/old log-probs + rewards/advantages
                    "logprob_s": clock["score"] - clock["gen"],
                    "update_s": total - clock["score"],
                    "tokens": clock["tokens"],
                    "rss_mb": _rss_mb(),
                }
            )

    def trl_reward(completions, **kwargs):
        out = []
        for c in completions:
            text = c[0]["content"] if isinstance(c, list) else c
            out.append(reward(text))
        return out

    rows = len(spec["prompts"]) * spec["group_size"]
    if rows % spec["micro_batch"]:
        raise ValueError(f"prompts x group_size = {rows} must be a multiple of --micro-batch {spec['micro_batch']}")
    with tempfile.TemporaryDirectory() as out_dir:
        args = GRPOConfig(
            output_dir=out_dir,
            per_device_train_batch_size=spec["micro_batch"],
            gradient_accumulation_steps=rows // spec["micro_batch"],
            num_generations=spec["group_size"],
            max_completion_length=spec["max_new_tokens"],
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            beta=spec["beta"],
            loss_type="grpo",
            learning_rate=1e-5,
            max_grad_norm=1.0,
            max_steps=spec["warmup"] + spec["steps"],
            gradient_checkpointing=True,
            bf16=False,
            use_cpu=True,
            logging_steps=10_000,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            seed=spec["seed"],
            dataloader_num_workers=0,
            model_init_kwargs={"dtype": torch.float32, "attn_implementation": "sdpa"},
        )
        dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": q}] for q in spec["prompts"]]})
        lora = LoraConfig(r=spec["lora_r"], lora_alpha=2 * spec["lora_r"], lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
        trainer = TimedGRPO(model=spec["model_dir"], reward_funcs=trl_reward, args=args, train_dataset=dataset, peft_config=lora, callbacks=[Timer()])
        trainer.train()
    return {"steps": records[spec["warmup"] :], "peak_rss_mb": _rss_mb()}


# -- driver ---------------------------------------------------------------------------------------


def ensure_trl_venv(python: str | None) -> str:
    """The TRL side's interpreter: benchmarks/.venv-trl, created on first use.

    torch goes in first, from the CPU wheel on this machine's disk when there is one: an unpinned
    torch from the index would pull several GB of CUDA libraries.
    """
    if python:
        return python
    exe = TRL_VENV / "bin" / "python"
    if exe.exists() and subprocess.run([str(exe), "-c", "import trl, peft, transformers"], capture_output=True).returncode == 0:
        return str(exe)
    import transformers

    print(f"[step] creating {TRL_VENV} (torch 2.13 CPU, trl=={TRL_VERSION}, transformers=={transformers.__version__})", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(TRL_VENV)], check=True)
    wheels = sorted(Path("/opt/wheels").glob(TORCH_WHEEL_GLOB))
    torch_req = str(wheels[-1]) if wheels else "torch==2.13.0"
    pip = [str(exe), "-m", "pip", "install", "-q"]
    extra = [] if wheels else ["--index-url", "https://download.pytorch.org/whl/cpu"]
    subprocess.run(pip + [torch_req] + extra, check=True)
    subprocess.run(pip + [f"trl=={TRL_VERSION}", f"transformers=={transformers.__version__}", "peft", "psutil"], check=True)
    return str(exe)


def run_worker(side: str, python: str, spec: dict, timeout: float) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
        spec_path = f.name
    out_path = spec_path + ".out"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), TOKENIZERS_PARALLELISM="false")
    env.setdefault("OMP_NUM_THREADS", str(spec["threads"]))
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


def summarise(runs: list[dict]) -> dict:
    steps = [s for r in runs for s in r["steps"]]
    med = lambda key: statistics.median(s[key] for s in steps)  # noqa: E731
    tok_s = statistics.median(s["tokens"] / s["generation_s"] for s in steps)
    return {
        "n_steps": len(steps),
        "step_s": med("step_s"),
        "generation_s": med("generation_s"),
        "logprob_s": med("logprob_s"),
        "update_s": med("update_s"),
        "tokens": med("tokens"),
        "gen_tokens_per_s": tok_s,
        "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in runs),
        "all_steps": steps,
    }


def table(ours: dict, trl: dict) -> str:
    rows = [
        ("step wall time (s)", "step_s", "{:.2f}"),
        ("  generation (s)", "generation_s", "{:.2f}"),
        ("  log-probs: old/ref (s)", "logprob_s", "{:.2f}"),
        ("  update: fwd+bwd+opt (s)", "update_s", "{:.2f}"),
        ("generated tokens / step", "tokens", "{:.0f}"),
        ("generation tokens/s", "gen_tokens_per_s", "{:.1f}"),
        ("peak RSS (MB)", "peak_rss_mb", "{:.0f}"),
    ]
    lines = [f"| {'':28} | {'lldslight':>10} | {'TRL':>10} | {'ratio':>6} |", f"|{'-' * 30}|{'-' * 12}|{'-' * 12}|{'-' * 8}|"]
    for label, key, fmt in rows:
        a, b = ours[key], trl[key]
        ratio = a / b if b else float("nan")
        lines.append(f"| {label:28} | {fmt.format(a):>10} | {fmt.format(b):>10} | {ratio:>6.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=2, help="distinct prompts per step (<= %d)" % len(PROMPTS))
    p.add_argument("--group-size", type=int, default=4, help="G, completions per prompt")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=4, help="rows per forward/backward (TRL: per_device_train_batch_size)")
    p.add_argument("--micro-batch-tokens", type=int, default=None, help="lldslight only: pack micro-batches by token budget")
    p.add_argument("--logprob-chunk-size", type=int, default=None, help="lldslight only: positions per vocabulary chunk (default: the library's)")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--beta", type=float, default=0.0, help="KL coefficient (0 = no reference pass, both sides)")
    p.add_argument("--steps", type=int, default=2, help="measured steps per run (after one warm-up step)")
    p.add_argument("--rounds", type=int, default=2, help="alternating A B rounds; medians over rounds x steps")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", choices=["lldslight", "trl"], default=None, help="run one side (debugging)")
    p.add_argument("--trl-python", default=None, help="interpreter with trl installed (default: benchmarks/.venv-trl, created on demand)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per worker run")
    p.add_argument("--json", default=None, help="write the figures here")
    p.add_argument("--worker", choices=["lldslight", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:
        spec = json.loads(Path(args.spec).read_text())
        result = worker_lldslight(spec) if args.worker == "lldslight" else worker_trl(spec)
        Path(args.out).write_text(json.dumps(result))
        return

    if not 1 <= args.prompts <= len(PROMPTS):
        raise SystemExit(f"--prompts must be in 1..{len(PROMPTS)}, got {args.prompts}")
    from lldslight.policy import PolicyConfig, resolve_model_dir

    model_dir = resolve_model_dir(PolicyConfig())  # de-quantises the bundled GGUF once
    spec = {
        "model_dir": model_dir,
        "prompts": PROMPTS[: args.prompts],
        "group_size": args.group_size,
        "max_new_tokens": args.max_new_tokens,
        "micro_batch": args.micro_batch,
        "micro_batch_tokens": args.micro_batch_tokens,
        "logprob_chunk_size": args.logprob_chunk_size,
        "lora_r": args.lora_r,
        "beta": args.beta,
        "steps": args.steps,
        "warmup": 1,
        "threads": args.threads,
        "seed": args.seed,
    }
    sides = [args.only] if args.only else ["lldslight", "trl"]
    pythons = {"lldslight": sys.executable}
    if "trl" in sides:
        pythons["trl"] = ensure_trl_venv(args.trl_python)
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    for rnd in range(args.rounds):
        for side in sides:
            res = run_worker(side, pythons[side], spec, args.timeout)
            runs[side].append(res)
            steps = ", ".join(f"{s['step_s']:.1f}" for s in res["steps"])
            print(f"[step] round {rnd + 1}/{args.rounds} {side:9} steps [{steps}] s, peak RSS {res['peak_rss_mb']:.0f} MB, run {res['wall_s']:.0f} s", flush=True)

    figures = {s: summarise(r) for s, r in runs.items()}
    report = {"config": {k: v for k, v in spec.items() if k != "prompts"}, "machine": machine(), **figures}
    print()
    print(
        f"GRPO step, single-turn, SmolLM2-135M-Instruct fp32 LoRA r={args.lora_r}: {args.prompts} prompts x G={args.group_size}, "
        f"{args.max_new_tokens} new tokens, micro-batch {args.micro_batch}, beta {args.beta}, 1 update/step; "
        f"medians of {args.rounds} alternating runs x {args.steps} steps; {args.threads} threads"
    )
    if len(sides) == 2:
        ours, theirs = figures["lldslight"], figures["trl"]
        report["step_time_ratio"] = ours["step_s"] / theirs["step_s"]
        report["peak_rss_ratio"] = ours["peak_rss_mb"] / theirs["peak_rss_mb"]
        report["generation_tokens_per_s_ratio"] = ours["gen_tokens_per_s"] / theirs["gen_tokens_per_s"]
        print(table(ours, theirs))
    else:
        print(json.dumps({k: v for k, v in figures[sides[0]].items() if k != "all_steps"}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


def machine() -> dict:
    import platform

    import torch

    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "loadavg_at_end": os.getloadavg(),
    }


if __name__ == "__main__":
    main()
