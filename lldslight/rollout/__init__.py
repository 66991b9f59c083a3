"""Multi-turn, search-augmented generation (the Search-R1 protocol); see engine.py."""
from lldslight.rollout.engine import *  # noqa: F401,F403
from lldslight.rollout.engine import _eos_ids  # noqa: F401
