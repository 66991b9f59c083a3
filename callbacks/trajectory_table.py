"""The old home of the per-turn trajectory table, kept so that configs naming
``callbacks.trajectory_table.TrajectoryTable`` keep working. The table is now part of the library:
``lldslight.callbacks.TrajectoryTable`` (lldslight/callbacks/traces.py), which also writes it to
TensorBoard and W&B (docs/traces.md).
"""
from lldslight.callbacks.traces import TrajectoryTable

__all__ = ["TrajectoryTable"]
