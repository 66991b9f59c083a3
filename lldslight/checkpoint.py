"""Deprecated: moved to :mod:`lldslight.checkpoint_io` (checkpoint files: atomic writes, RNG
streams, the trainable-keys check, ``--ckpt_path last``). Old imports and configs that name
``lldslight.checkpoint.AtomicCheckpointIO`` keep working, with a DeprecationWarning."""
from lldslight.lazy import moved_module

__getattr__, __dir__ = moved_module(__name__, "lldslight.checkpoint_io")
