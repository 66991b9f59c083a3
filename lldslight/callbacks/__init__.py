"""Callbacks that compose a run in YAML: rollouts, the LLDS term, guards, diagnostics, summaries."""
from lldslight.callbacks.rollout import SearchRollout
from lldslight.callbacks.summary import RunSummary

__all__ = ["SearchRollout", "RunSummary"]
