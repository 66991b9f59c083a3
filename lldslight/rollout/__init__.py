"""Multi-turn, search-augmented generation: the Search-R1 protocol (docs/algorithm.md §1),
token-in/token-out. One concern per file:

- protocol.py: the protocol as text: action tags, parsing a turn, the observation and
  invalid-action strings, tokenising prompts and observations, the end-of-turn token ids;
- layout.py: a trajectory's token layout (``Layout``) and the packer (``pack``), shared with the
  warm start (lldslight/sft.py);
- answer.py: detokenising token by token, and the final answer's token span;
- cache.py: the ragged KV cache of a rollout batch (``RaggedCache``) and the forward over it
  (``Decoder``), public for the speed tools that measure them (benchmarks/decode_ops.py);
- engine.py: ``RolloutConfig`` and ``RolloutEngine``: the scheduling, the sampler, the scored
  Trajectory.

Imports go one way: engine.py imports its four siblings, which import none of the others.
Inside the package they are relative, so an older copy of the package can be loaded beside this
one from its folder (benchmarks/generation.py ``--baseline-rollout``). Every public name is
re-exported here: ``from lldslight.rollout import X`` is the import to use.
"""
from .answer import answer_token_span, token_texts
from .cache import Decoder, RaggedCache
from .engine import RolloutConfig, RolloutEngine
from .layout import Layout, pack
from .protocol import INVALID_ACTION, STOP_TAGS, eos_ids, format_observation, observation_ids, parse_action, prompt_token_ids

__all__ = [
    "INVALID_ACTION",
    "STOP_TAGS",
    "Decoder",
    "Layout",
    "RaggedCache",
    "RolloutConfig",
    "RolloutEngine",
    "answer_token_span",
    "eos_ids",
    "format_observation",
    "observation_ids",
    "pack",
    "parse_action",
    "prompt_token_ids",
    "token_texts",
]
