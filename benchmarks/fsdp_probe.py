"""Per-rank step time and peak GPU memory for benchmarks/fsdp_gpu.sh, and the table it prints.

    GpuProbe       a callback: per training step, wall time, the module's time split, and
                   torch.cuda.max_memory_allocated / reserved of this rank; one JSON per rank.
    python benchmarks/fsdp_probe.py report DIR...   the table (first step left out: warm-up).
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch

GIB = 1024**3


class GpuProbe(pl.Callback):
    def __init__(self, out_dir: str, label: str = "") -> None:
        self.out = Path(out_dir)
        self.label = label
        self.steps: list[dict] = []
        self._t0 = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        step = {"step_s": time.perf_counter() - self._t0, **{k: float(v) for k, v in pl_module.timings.items()}}
        if torch.cuda.is_available():
            step["peak_alloc_gib"] = torch.cuda.max_memory_allocated() / GIB
            step["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
        self.steps.append(step)

    def on_fit_end(self, trainer, pl_module) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        params = sum(p.numel() for p in pl_module.parameters())  # global sizes (DTensor numel is global)
        record = {
            "label": self.label or self.out.name,
            "world_size": trainer.world_size,
            "strategy": type(trainer.strategy).__name__,
            "params": params,
            "trainable": sum(p.numel() for p in pl_module.parameters() if p.requires_grad),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "steps": self.steps,
        }
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record, indent=1))


def report(dirs: list[str]) -> str:
    head = ("| run | GPUs | module params (policy + reference) | trainable | step s (median) | rollout s | log-prob s | update s "
            "| peak alloc GiB/GPU (max over ranks) | peak reserved GiB/GPU |\n|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for d in dirs:
        ranks = [json.loads(p.read_text()) for p in sorted(Path(d).glob("rank*.json"))]
        if not ranks:
            lines.append(f"| {Path(d).name} | (no result: see its log) | | | | | | | | |")
            continue
        r0 = ranks[0]
        measured = [s for s in r0["steps"][1:]] or r0["steps"]

        def med(key: str) -> float:
            values = [s.get(key, float("nan")) for s in measured]
            return statistics.median(values) if values else float("nan")

        peak = max(max((s.get("peak_alloc_gib", 0.0) for s in r["steps"]), default=0.0) for r in ranks)
        reserved = max(max((s.get("peak_reserved_gib", 0.0) for s in r["steps"]), default=0.0) for r in ranks)
        lines.append(
            f"| {r0['label']} | {r0['world_size']} | {r0['params'] / 1e6:.0f}M | {r0['trainable'] / 1e6:.1f}M "
            f"| {med('step_s'):.2f} | {med('rollout_s'):.2f} | {med('logprob_s'):.2f} | {med('update_s'):.2f} "
            f"| {peak:.2f} | {reserved:.2f} |"
        )
    gpu = next((json.loads(p.read_text())["gpu"] for d in dirs for p in Path(d).glob("rank0.json")), "?")
    return f"GPU: {gpu}\n" + "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] != "report":
        raise SystemExit("usage: python benchmarks/fsdp_probe.py report DIR [DIR...]")
    print(report(sys.argv[2:]))
