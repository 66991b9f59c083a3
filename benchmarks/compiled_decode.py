"""The compiled decode step (``rollout.compile_decode``) against the eager one, at 8 and 32 rows,
1 and 2 threads, bf16 (where this CPU has native bf16) and fp32, against the physical limit.

    python benchmarks/compiled_decode.py --json benchmarks/results/compiled_decode.json
    python benchmarks/compiled_decode.py --precisions fp32 --threads 1 --rows 8 --rounds 1 --steps 4   # a smoke run

Each (precision, threads) runs in its own process (inductor's kernels take the thread count they
were compiled with), which runs benchmarks/decode_ops.py's sides "current" (eager) and "compiled"
alternating, with ``--bounds``, at each ``--rows`` in turn: SmolLM2-135M-Instruct (the bundled
demo model) with LoRA r=16 on every Linear as the sampler runs it (bf16-mixed: the adapter path;
fp32: LoRA folded into the weights), ``--context`` tokens of context. The decode step is compiled
once per process, at the first rows; the compile time reported is that first step's wall time.
The table gives ms per decode step (medians over rounds), compiled / eager, the physical limit
(benchmarks/bounds.py: weights read once at the measured bandwidth, or FLOPs at the large-shape
matmul peak, whichever is larger) and the fraction of it each side reaches (the target is 40%),
the largest logit difference between the sides, and the load. The JSON holds every run
(decode_ops' report per cell), the CPU model and SIMD flags.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def child(args: argparse.Namespace) -> None:
    """One (precision, threads): decode_ops at each rows, one process; the reports to --json."""
    # benchmarks/decode_ops.py, beside this file (on sys.path as the script's own folder; a package
    # member under python -m benchmarks.compiled_decode)
    decode_ops = importlib.import_module(f"{__package__}.decode_ops" if __package__ else "decode_ops")

    reports = []
    for rows in args.rows:
        argv = ["--sides", "current", "compiled", "--bounds", "--precision", args.precisions[0], "--threads", str(args.threads[0]),
                "--rows", str(rows), "--context", str(args.context), "--steps", str(args.steps), "--rounds", str(args.rounds),
                *args.harness]
        reports.append(decode_ops.main(argv))
    Path(args.json).write_text(json.dumps(reports, indent=1))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--precisions", nargs="+", default=None, choices=["bf16-mixed", "fp32"],
                   help="default: bf16-mixed (where this CPU has native bf16) and fp32")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rows", type=int, nargs="+", default=[8, 32])
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--harness", nargs=argparse.REMAINDER, default=[],
                   help="the rest is passed to decode_ops (benchmarks/harness.py's options: --quiet-threshold, --retries, ...)")
    args = p.parse_args(argv)
    if args.child:
        return child(args)
    from lldslight.policy import cpu_bf16_support, cpu_description

    precisions = args.precisions or (["bf16-mixed"] if cpu_bf16_support().native else []) + ["fp32"]
    cells = []
    for precision in precisions:
        for threads in args.threads:
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "reports.json"
                cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--precisions", precision, "--threads", str(threads),
                       "--rows", *map(str, args.rows), "--context", str(args.context), "--steps", str(args.steps),
                       "--rounds", str(args.rounds), "--json", str(out), "--harness", *args.harness]
                print(f"\n== {precision}, {threads} thread(s): {' '.join(cmd[1:])}", flush=True)
                subprocess.run(cmd, check=True, env=os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")]))})
                cells += [{"precision": precision, "threads": threads, "rows": r["config"]["rows"], "report": r}
                          for r in json.loads(out.read_text())]
    report = {"config": {k: getattr(args, k) for k in ("threads", "rows", "context", "steps", "rounds")} | {"precisions": precisions},
              "cpu": cpu_description(), "cells": cells}
    cpu = report["cpu"]
    print(f"\nDecode step, eager vs rollout.compile_decode: on; SmolLM2-135M-Instruct + LoRA r=16, {args.context} tokens of "
          f"context; {cpu['cpu_model']} (SIMD: {', '.join(cpu['cpu_flags_simd'])}); medians of {args.rounds} alternating rounds "
          f"of {args.steps} steps")
    print("| precision, rows, threads | eager (ms) | compiled (ms) | compiled / eager | physical limit (ms) | eager / limit | "
          "compiled / limit | first compiled step (s) | largest logit difference | load average at start | quiet |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for c in cells:
        r = c["report"]
        eager, comp = r["sides"]["current"]["ms_per_step"]["median"], r["sides"]["compiled"]["ms_per_step"]["median"]
        limit = r["bounds"]["bound_ms"]
        compile_s = f"{r['compile_s']:.1f}"  # the first compiled step: the compilation at the first rows, reuse after
        print(f"| {c['precision']}, {c['rows']}, {c['threads']} | {eager:.1f} | {comp:.1f} | {comp / eager:.2f} | {limit:.1f} | "
              f"{limit / eager:.0%} | {limit / comp:.0%} | {compile_s} | {r['max_abs_logit_difference']['compiled']:.3g} | "
              f"{r['quiet']['loadavg_start_max']:.2f} | {'yes' if r['quiet']['quiet'] else 'NO: do not quote'} |")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
