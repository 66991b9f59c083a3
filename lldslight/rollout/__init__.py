"""Multi-turn, search-augmented generation: the Search-R1 protocol (docs/algorithm.md §1),
token-in/token-out. One concern per file:

- protocol.py: the protocol as text: action tags, parsing a turn, the observation and
  invalid-action strings, tokenising prompts and observations, the end-of-turn token ids;
- layout.py: a trajectory's token layout (``Layout``) and the packer (``pack``), shared with the
  warm start (lldslight/sft.py);
- answer.py: detokenising token by token, and the final answer's token span;
- cache.py: the ragged KV cache of a rollout batch (``RaggedCache``) and the forward over it
  (``Decoder``), public for the speed tools that measure them (benchmarks/decode_ops.py);
- episode.py: one rollout's turns under the protocol's rules (``Episode``, ``EpisodeRules``), and
  the finished rollouts packed and scored into a Trajectory: what every backend shares;
- compiled.py: ``CompiledDecode``, the engine's decode step through ``torch.compile``
  (``rollout.compile_decode``), eager where it is off or fails;
- engine.py: ``RolloutConfig`` and ``RolloutEngine``: the default backend's scheduling and sampler;
- hf_generate.py: ``HFGenerate``, the reference backend (transformers' ``generate``, one turn per call);
- vllm_generate.py: ``VLLMGenerate``, the vLLM backend (a server or ``vllm.LLM``; the adapter pushed
  after every update and checked by the probe);
- backend.py: ``GenerationBackend``, the seam: what a backend receives and must return;
- settings.py: ``SamplingSettings``, what a backend samples with, said at start and checked against
  the config (never the model's generation_config);
- sync.py: ``WeightSync``, the check after each update that the backend samples from the new weights.

Around the rollouts, imported by their own path (``from lldslight.rollout.evaluation import
paired_change``), absolute, and not re-exported here:

- bounds.py: the sizes a user types (prompts, turns, rollout rows) against the model's context and
  the machine's memory, checked before the weights load;
- dynamic_sampling.py: dynamic sampling (DAPO), an option of ``SearchRollout``: further rounds until
  enough groups have mixed rewards, the ranks agreeing;
- evaluation.py: the records of evaluation rollouts, gathered over ranks and summarised.

Imports go one way: backend.py and hf_generate.py import engine.py and the rest; engine.py imports
episode.py, cache.py, compiled.py (which imports cache.py), protocol.py, settings.py and sync.py; episode.py imports answer.py, layout.py and
protocol.py, which import none of the others; settings.py imports protocol.py, sync.py none of them.
Inside the package they are relative, so an older copy of the package can be loaded beside this
one from its folder (benchmarks/generation.py ``--baseline-rollout``). Every public name of
those files is re-exported here: ``from lldslight.rollout import X`` is the import to use.
"""
from .answer import answer_token_span, token_texts
from .backend import BackendFactory, GenerationBackend
from .cache import Decoder, RaggedCache
from .compiled import CompiledDecode
from .engine import RolloutConfig, RolloutEngine
from .episode import Episode, EpisodeRules
from .hf_generate import HFGenerate
from .layout import Layout, pack
from .protocol import INVALID_ACTION, STOP_TAGS, eos_ids, format_observation, observation_ids, parse_action, prompt_token_ids
from .settings import SamplingSettings
from .sync import WeightSync
from .vllm_generate import VLLMGenerate

__all__ = [
    "BackendFactory",
    "CompiledDecode",
    "Episode",
    "EpisodeRules",
    "GenerationBackend",
    "HFGenerate",
    "INVALID_ACTION",
    "STOP_TAGS",
    "Decoder",
    "Layout",
    "RaggedCache",
    "RolloutConfig",
    "RolloutEngine",
    "SamplingSettings",
    "VLLMGenerate",
    "WeightSync",
    "answer_token_span",
    "eos_ids",
    "format_observation",
    "observation_ids",
    "pack",
    "parse_action",
    "prompt_token_ids",
    "token_texts",
]
