"""What SIGTERM does, by what the run is doing when it arrives (docs/errors_and_resume.md, "Faults").

Lightning answers SIGTERM by setting a flag that its loops read between batches: the training step
in flight is finished and checkpointed, then the run stops. That is right while a step's update runs
(its weights are half-changed until the step's checkpoint is written), and wrong everywhere else:

- an evaluation (before or after training, a validation pass, ``validate``/``test``) holds nothing a
  checkpoint keeps, and one evaluation batch can take minutes on a loaded CPU, so the flag was read
  only after minutes (a scheduler's SIGKILL after its 30-120 s grace period came first);
- a training step's rollout holds nothing either (a resume from the last checkpoint samples it again,
  bit for bit), and a SIGTERM that came just after a step's checkpoint waited for a whole further
  step, rollout and update.

So the code that samples marks itself :func:`interruptible`: a SIGTERM inside it stops the run at
once, with Lightning's own exception for a SIGTERM stop (``SIGTERMException``, after which Lightning
tears the run down as for any stop). A SIGTERM outside it (an update, a checkpoint or metrics write,
the model loading) is remembered: the run stops at the end of the step (Lightning's flag) or where the
next interruptible work would begin, whichever comes first, and the line said at once tells how long
the update in flight may take (how long the previous one took). Python's own Ctrl-C
(KeyboardInterrupt) already stops anywhere.

With several processes (DDP, FSDP) a rank that stopped at once could leave the others waiting in a
collective, so there every SIGTERM waits for the end of the step, as Lightning does.
"""
from __future__ import annotations

import signal
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator, Optional

NOW = ("[lldslight] SIGTERM: stopping now, during {what} (it holds nothing a checkpoint keeps: a resume "
       "samples it again); the last checkpoint written stays")
AFTER_UPDATE = ("[lldslight] SIGTERM: finishing the update of training step {step} in flight ({timing}), then "
                "stopping after the step's checkpoint; SIGKILL stops at once (the last checkpoint written stays)")
NEXT = ("[lldslight] SIGTERM: no training update is in flight; stopping where the next rollout or evaluation "
        "would begin; SIGKILL stops at once (the last checkpoint written stays)")
RANKS = ("[lldslight] SIGTERM: finishing the training step in flight on every rank (its rollout and update), "
         "then stopping after the step's checkpoint; SIGKILL stops at once (the last checkpoint written stays)")


class _State:
    def __init__(self) -> None:
        self.received = False  # a SIGTERM came since install()
        self.raised = False  # the run is already stopping: a second SIGTERM must not raise inside the teardown
        self.region: Optional[str] = None  # the interruptible work in progress, in words
        self.update_step: Optional[int] = None  # the 1-based step whose update is in flight
        self.update_t0 = 0.0
        self.last_update_s: Optional[float] = None  # the previous step's update, checkpoint and writes


_state = _State()


def _several_ranks() -> bool:
    import torch

    return torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1


def _seconds(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min"


def _timing() -> str:
    began = f"it began {_seconds(time.monotonic() - _state.update_t0)} ago"
    if _state.last_update_s is None:
        return f"{began}; the first update of this run, none finished yet to time it by"
    return f"{began}; the previous step's update and checkpoint took {_seconds(_state.last_update_s)}"


def _raise() -> None:
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    _state.raised = True
    raise SIGTERMException()


def _on_sigterm(signum: int, frame: Any) -> None:
    if _state.raised:
        return  # already stopping (the teardown runs now: a write there must not be cut)
    first, _state.received = not _state.received, True
    if _several_ranks():
        if first:
            print(RANKS, file=sys.stderr, flush=True)
        return
    if _state.region is not None:
        print(NOW.format(what=_state.region), file=sys.stderr, flush=True)
        _raise()
    if first:
        line = AFTER_UPDATE.format(step=_state.update_step, timing=_timing()) if _state.update_step is not None else NEXT
        print(line, file=sys.stderr, flush=True)


def install() -> Any:
    """Handle SIGTERM as above for one run (Lightning composes a handler found installed with its
    own flag). Returns the handler to give back to :func:`restore`; None where none was installed (not
    the main thread, or a handler someone else installed is kept)."""
    global _state
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        return None
    _state = _State()
    return signal.signal(signal.SIGTERM, _on_sigterm)


def restore(previous: Any) -> None:
    if previous is not None:
        signal.signal(signal.SIGTERM, previous)


def received() -> bool:
    """Whether a SIGTERM came during the run (Lightning's own flag is reset when its handlers are
    installed, so one that came while the model loaded is known only here)."""
    return _state.received


def _end_update() -> None:
    if _state.update_step is not None:
        _state.last_update_s = time.monotonic() - _state.update_t0
        _state.update_step = None


def update_began(step: int) -> None:
    """Training step ``step`` (1-based) has its rollout and now updates the weights: a SIGTERM waits
    for its checkpoint."""
    _state.update_step, _state.update_t0 = step, time.monotonic()


def update_ended() -> None:
    """No update is in flight any more (the training loop ended)."""
    _end_update()


@contextmanager
def interruptible(what: str) -> Iterator[None]:
    """Work that a SIGTERM may cut short (``what``: its name in the line said then, e.g. "the
    evaluation after training"). Ends the update in flight; a SIGTERM that came before stops the run
    here, before the work starts."""
    _end_update()
    if _state.received and not _state.raised and not _several_ranks():
        _raise()  # the line was said when the SIGTERM came
    outer, _state.region = _state.region, what
    try:
        yield
    finally:
        _state.region = outer
