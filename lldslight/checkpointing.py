"""Deprecated: moved to :mod:`lldslight.activation_checkpointing` (activation checkpointing under a
byte budget, ``policy.gradient_checkpointing: auto``). Old imports keep working, with a
DeprecationWarning."""
from lldslight.lazy import moved_module

__getattr__, __dir__ = moved_module(__name__, "lldslight.activation_checkpointing")
