"""Deprecated: moved to :mod:`lldslight.science.collapse` (the collapse science, lldslight/science/).
Old imports keep working, with a DeprecationWarning."""
from lldslight.lazy import moved_module

__getattr__, __dir__ = moved_module(__name__, "lldslight.science.collapse")
