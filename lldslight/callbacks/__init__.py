"""Callbacks that compose a run in YAML: rollouts, the LLDS term, guards, diagnostics, the collapse
alarm and healing, summaries, per-turn trace tables."""
from lldslight.callbacks.alarm import AlarmEvent, CollapseAlarm
from lldslight.callbacks.drift import AdaptiveRate
from lldslight.callbacks.dynamic_sampling import DynamicSampling
from lldslight.callbacks.guard import GradientSpikeGuard
from lldslight.callbacks.heal import Heal
from lldslight.callbacks.llds import LLDS
from lldslight.callbacks.monitor import LLDMonitor
from lldslight.callbacks.probe import LLDProbe
from lldslight.callbacks.rollout import SearchRollout, SearchRolloutOptions
from lldslight.callbacks.signal import GroupSignal
from lldslight.callbacks.summary import RunSummary
from lldslight.callbacks.traces import TrajectoryTable

__all__ = [
    "SearchRollout", "SearchRolloutOptions", "RunSummary", "LLDMonitor", "LLDS", "GradientSpikeGuard", "DynamicSampling",
    "CollapseAlarm", "AlarmEvent", "Heal", "LLDProbe", "AdaptiveRate",
    "TrajectoryTable", "GroupSignal",
]
