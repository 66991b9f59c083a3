"""Deprecated: ``DynamicSampling``, kept so that configs naming it still run.

Dynamic sampling is an option of the rollout callback, ``SearchRollout(dynamic_sampling={enabled:
true, max_rounds: N})`` (the algorithm is lldslight/rollout/dynamic_sampling.py); from a config composed
after the one that defines the SearchRollout, append ``SearchRolloutOptions`` with that option, as
``configs/dynamic_sampling.yaml`` does. The names below are re-exported from their new home.
"""
from __future__ import annotations

from lightning.pytorch.utilities import rank_zero_deprecation

from lldslight.callbacks.rollout import SearchRolloutOptions
from lldslight.rollout.dynamic_sampling import DynamicSamplingConfig, SampleResult, mixed_groups, sample_mixed_groups

__all__ = ["DynamicSampling", "DynamicSamplingConfig", "SampleResult", "mixed_groups", "sample_mixed_groups"]


class DynamicSampling(SearchRolloutOptions):
    """Deprecated: turns on the run's ``SearchRollout(dynamic_sampling=...)`` option, as
    ``SearchRolloutOptions(dynamic_sampling={enabled: true, max_rounds: max_rounds})`` does; warns
    (DeprecationWarning) with the replacement.

    Args:
        max_rounds: extra sampling rounds per training step at most.
    """

    def __init__(self, max_rounds: int = 4) -> None:
        rank_zero_deprecation(
            "lldslight.callbacks.DynamicSampling is deprecated: dynamic sampling is SearchRollout's option "
            f"`dynamic_sampling: {{enabled: true, max_rounds: {max_rounds}}}` (in the SearchRollout's init_args; from a "
            "config composed on top, append lldslight.callbacks.SearchRolloutOptions with that option, as "
            "configs/dynamic_sampling.yaml does)"
        )
        super().__init__(dynamic_sampling=DynamicSamplingConfig(enabled=True, max_rounds=max_rounds))
