"""Where one GRPO step's time goes, as shares: torch.profiler over one step, every op's self time
attributed to the innermost labelled region around it, and grouped.

Regions are labelled from outside the library, through public entry points only: the benchmark
wraps the phases it already times (rollout, log-probs, update, backward), forward hooks on the
model's decoder and output projection (``get_decoder()`` / ``get_output_embeddings()``, HF API) label
each call by its kind (a 1-token decode step, a prefill, a forward with gradients), and torch's
global optimiser hooks label the optimiser step. Inside a region, ops are split by kind (matmuls,
attention, softmax/sampling, other ops); a region's own self time, outside any op, is the Python
between ops (host overhead).

Shares, not seconds: the profiler's per-op cost inflates every op a little, and load on a shared
machine scales everything; the proportions move far less than the totals.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch
from torch.autograd.profiler import record_function

LABELS = ("step", "rollout", "log-probs", "update", "backward", "optimizer step",
          "decoder: prefill", "decoder: 1 token", "decoder: forward with grad", "vocab projection")

MATMUL = {"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::baddbmm"}
SOFTMAX = {"aten::softmax", "aten::_softmax", "aten::log_softmax", "aten::_log_softmax", "aten::multinomial",
           "aten::exp", "aten::gather", "aten::argmax", "aten::topk", "aten::sort", "aten::_log_softmax_backward_data",
           "aten::_softmax_backward_data"}


def op_kind(name: str) -> str:
    if name in MATMUL:
        return "matmul"
    if "scaled_dot_product" in name or "attention" in name:
        return "attention"
    if name in SOFTMAX:
        return "softmax"
    return "other ops"


def group(path: tuple[str, ...], kind: str) -> str:
    """The report's group for an op of ``kind`` (or "host": a region's own time) under ``path``
    (labels, outermost first). Priority: generation, then log-probs, then the update's parts."""
    if "rollout" in path:
        if "decoder: 1 token" in path:
            return {"matmul": "generation: decode matmuls", "attention": "generation: decode attention",
                    "host": "generation: decode host (module Python)"}.get(kind, "generation: decode other ops")
        if "decoder: prefill" in path:
            return "generation: prefill"
        if "vocab projection" in path:
            return "generation: vocab projection"
        if kind == "softmax":
            return "generation: sampling"
        return "generation: host bookkeeping"
    if "log-probs" in path:
        return "log-probs (old/ref)"
    if "backward" in path:
        return "update: backward (with recompute)"
    if "optimizer step" in path:
        return "update: optimiser"
    if "decoder: forward with grad" in path:
        return "update: log-prob forward (decoder)"
    if "vocab projection" in path:
        return "update: vocab projection"
    if "update" in path:
        return "update: vocab log-softmax/entropy" if kind == "softmax" else "update: other (loss, grad norm, bookkeeping)"
    return "other (Lightning loop, callbacks)"


class _Region:
    """A record_function entered by one hook and left by another (pre/post forward hooks)."""

    def __init__(self) -> None:
        self.stack: list[Any] = []

    def enter(self, name: str) -> None:
        rf = record_function(name)
        rf.__enter__()
        self.stack.append(rf)

    def exit(self) -> None:
        if self.stack:
            self.stack.pop().__exit__(None, None, None)


def _causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    return model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model


class StepProfiler:
    """Hooks that label a model's decoder and output projection and the optimiser step, and a
    torch.profiler window. ``with prof.window(): one step``; then ``prof.shares()``."""

    def __init__(self, model: torch.nn.Module) -> None:
        lm = _causal_lm(model)
        decoder, head = lm.get_decoder(), lm.get_output_embeddings()
        self._regions = _Region()
        self._handles = []
        self.active = False

        def decoder_pre(module, args, kwargs):
            if not self.active:
                return
            ids = kwargs.get("input_ids", args[0] if args else None)
            length = ids.shape[-1] if ids is not None else kwargs["inputs_embeds"].shape[-2]
            name = "decoder: forward with grad" if torch.is_grad_enabled() else ("decoder: 1 token" if length == 1 else "decoder: prefill")
            self._regions.enter(name)

        def head_pre(module, args):
            if self.active:
                self._regions.enter("vocab projection")

        def post(module, args, output):
            if self.active:
                self._regions.exit()

        def post_kw(module, args, kwargs, output):
            post(module, args, output)

        self._handles += [decoder.register_forward_pre_hook(decoder_pre, with_kwargs=True),
                          decoder.register_forward_hook(post_kw, with_kwargs=True),
                          head.register_forward_pre_hook(head_pre), head.register_forward_hook(post)]
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        def opt_pre(optimizer, args, kwargs):
            if self.active:
                self._regions.enter("optimizer step")

        def opt_post(optimizer, args, kwargs):
            if self.active:
                self._regions.exit()

        self._handles += [register_optimizer_step_pre_hook(opt_pre), register_optimizer_step_post_hook(opt_post)]
        self._prof: Optional[torch.profiler.profile] = None
        self._step: Optional[record_function] = None

    def start(self) -> None:
        self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self._prof.__enter__()
        self.active = True
        self._step = record_function("step")
        self._step.__enter__()

    def stop(self) -> None:
        self._step.__exit__(None, None, None)  # type: ignore[union-attr]
        self.active = False
        self._prof.__exit__(None, None, None)  # type: ignore[union-attr]
        for h in self._handles:
            h.remove()

    @contextlib.contextmanager
    def window(self) -> Iterator[None]:
        self.start()
        try:
            yield
        finally:
            self.stop()

    def shares(self) -> dict[str, Any]:
        """{"total_s", "groups": {group: {"s", "share"}}} for the profiled window."""
        return aggregate(self._prof.events())  # type: ignore[union-attr]


def label(name: str) -> contextlib.AbstractContextManager:
    """A labelled region (one of LABELS) around a phase the benchmark wraps."""
    return record_function(name)


def wrap(obj: Any, attr: str, name: str) -> Callable[[], None]:
    """Label every call of ``obj.attr`` (a method on a class or an instance); returns an undo."""
    original = getattr(obj, attr)

    def wrapped(*args, **kwargs):
        with record_function(name):
            return original(*args, **kwargs)

    setattr(obj, attr, wrapped)
    return lambda: setattr(obj, attr, original)


def aggregate(events: Any) -> dict[str, Any]:
    """Every event's self time, grouped by (labels around it, its kind)."""
    groups: dict[str, float] = {}
    total = 0.0
    for e in events:
        path = []
        p = e.cpu_parent
        while p is not None:
            if p.name in LABELS:
                path.append(p.name)
            p = p.cpu_parent
        path.reverse()
        if e.name in LABELS:
            path.append(e.name)
            kind = "host"
        else:
            kind = op_kind(e.name)
        if not path:
            continue  # outside the step (the profiler's own start and stop)
        seconds = e.self_cpu_time_total / 1e6
        g = group(tuple(path), kind)
        groups[g] = groups.get(g, 0.0) + seconds
        total += seconds
    return {"total_s": total, "groups": {g: {"s": s, "share": s / total if total else 0.0}
                                         for g, s in sorted(groups.items(), key=lambda x: -x[1])}}


def print_shares(profile: dict[str, Any], title: str) -> None:
    print(title)
    phases: dict[str, float] = {}
    for g, v in profile["groups"].items():
        phases[g.split(":")[0]] = phases.get(g.split(":")[0], 0.0) + v["share"]
    print("  by phase: " + ", ".join(f"{p} {s:.0%}" for p, s in sorted(phases.items(), key=lambda x: -x[1])))
    for g, v in profile["groups"].items():
        print(f"  {v['share']:6.1%}  {g}")
