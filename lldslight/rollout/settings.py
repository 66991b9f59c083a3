"""The sampling settings a generation backend samples with: said once when training starts, and
checked against the config, whatever the model's ``generation_config`` says.

An instruct model ships sampling defaults in its ``generation_config`` (Qwen2.5-Instruct:
temperature 0.7, top_p 0.8, top_k 20, repetition_penalty 1.05). transformers' ``generate`` fills
every field a call leaves unset from them (and before transformers 5 also overrode a field set to
its global default, such as temperature 1.0), so a backend that calls ``generate`` can sample with
settings no config names: rollouts nearly alike, no reward variance in a group, and log-probs
that are not those of the distribution sampled. Here:

- :class:`SamplingSettings`: what a backend samples with (temperature, top-p, top-k, the token
  budgets, the stop strings); ``configured`` is what the config asks for; a backend reports its own
  with ``sampling_settings()`` and SearchRollout refuses a difference (:func:`check`);
- :func:`describe`: the line printed when training starts, naming any sampling field of the
  model's generation_config that is not used;
- :func:`without_generation_config`: ``generate`` called with nothing to fill in from the model
  (HFGenerate);
- :func:`processed_scores_mismatch`: what ``generate`` did to one step's logits (its raw logits
  against its processed scores) against what the settings allow: HFGenerate checks every turn.

The engine (engine.py) never reads generation_config: its sampler takes the RolloutConfig only.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
from torch import Tensor, nn

from lldslight.errors import ConfigError

from .protocol import STOP_TAGS

# The fields of a generation_config that change what is sampled (the token budget and the stop
# tokens are the protocol's own: each turn's budget and EOS ids are given to every call).
SAMPLING_FIELDS = ("do_sample", "temperature", "top_p", "top_k", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff",
                   "repetition_penalty", "no_repeat_ngram_size", "min_new_tokens", "min_length", "bad_words_ids",
                   "suppress_tokens", "begin_suppress_tokens", "forced_bos_token_id", "forced_eos_token_id",
                   "sequence_bias", "encoder_repetition_penalty", "length_penalty")


@dataclass(frozen=True)
class SamplingSettings:
    """What a backend samples with, in the RolloutConfig's terms."""

    greedy: bool
    temperature: float
    top_p: float
    top_k: int  # 0 = off
    max_new_tokens: int  # per turn
    max_response_tokens: int  # per rollout, observations included
    stop: tuple[str, ...]  # the stop strings: the protocol's closing tags and the end-of-turn tokens

    @classmethod
    def configured(cls, config: Any, tokenizer: Any, eos_ids: list[int]) -> "SamplingSettings":
        """The settings a RolloutConfig asks for, with the protocol's stop strings."""
        return cls(greedy=config.greedy, temperature=float(config.temperature), top_p=float(config.top_p), top_k=int(config.top_k),
                   max_new_tokens=config.max_new_tokens, max_response_tokens=config.max_response_tokens,
                   stop=(*STOP_TAGS, *tokenizer.convert_ids_to_tokens(list(eos_ids))))

    def text(self) -> str:
        if self.greedy:
            how = "greedy"
        else:
            how = (f"temperature {self.temperature:g}, top_p {self.top_p:g}, "
                   f"top_k {self.top_k if self.top_k else 'off'}")
        return (f"{how}, max_new_tokens {self.max_new_tokens} per turn, max_response_tokens {self.max_response_tokens}, "
                f"stop {', '.join(repr(s) for s in self.stop)}")


def check(used: SamplingSettings, configured: SamplingSettings, backend: str) -> None:
    """A ConfigError naming every field where the backend's settings differ from the config's."""
    differ = [f.name for f in dataclasses.fields(SamplingSettings) if not _same(getattr(used, f.name), getattr(configured, f.name))]
    if differ:
        pairs = "; ".join(f"{name}: samples with {getattr(used, name)!r}, rollout config says {getattr(configured, name)!r}"
                          for name in differ)
        raise ConfigError(f"SearchRollout.backend {backend} does not sample as configured ({pairs}): rollouts and their "
                          "log-probs would not be those of the configured policy; make the backend take its settings "
                          "from the RolloutConfig it is built with, not from the model's generation_config")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    return a == b


def unused_generation_config(model: nn.Module) -> dict[str, Any]:
    """The sampling fields of the model's generation_config that differ from transformers' global
    defaults: what a plain ``generate`` call would sample with and lldslight does not."""
    from transformers import GenerationConfig

    config = _generation_config(model)
    if config is None:
        return {}
    defaults = GenerationConfig()
    return {k: getattr(config, k) for k in SAMPLING_FIELDS
            if getattr(config, k, None) is not None and getattr(config, k, None) != getattr(defaults, k, None)}


def describe(settings: SamplingSettings, backend: str, model: nn.Module) -> str:
    """The line printed when training starts: the settings the backend samples with, and what of
    the model's generation_config is not used."""
    line = f"[lldslight] sampling ({backend}): {settings.text()}"
    unused = unused_generation_config(model)
    if unused:
        line += f"; the model's generation_config ({', '.join(f'{k} {v}' for k, v in unused.items())}) is not used"
    return line


def _generation_config(model: nn.Module) -> Any:
    from transformers import GenerationConfig

    for module in model.modules():
        config = getattr(module, "generation_config", None)
        if isinstance(config, GenerationConfig):
            return config
    return None


@contextlib.contextmanager
def without_generation_config(model: nn.Module) -> Iterator[None]:
    """Inside, every generation_config of ``model`` (a wrapper such as peft's and the model it
    wraps) is transformers' global default, so ``generate`` fills nothing from the model's own:
    what a call does not set is transformers' default, and what it sets is used as set."""
    from transformers import GenerationConfig

    saved = [(m, m.generation_config) for m in model.modules() if isinstance(getattr(m, "generation_config", None), GenerationConfig)]
    try:
        for owner, _ in saved:
            owner.generation_config = GenerationConfig()
        yield
    finally:
        for owner, config in saved:
            owner.generation_config = config


def processed_scores_mismatch(raw: Tensor, processed: Tensor, settings: SamplingSettings) -> Optional[str]:
    """What is wrong with one decoding step's processed scores [V] (what ``generate`` sampled
    from) given its raw logits [V] and the settings, or None. Greedy: the scores must be the raw
    logits (no processor ran). Sampling: the tokens left must be the raw logits / temperature, and
    which are left must be what top-k and top-p allow: all of them when both are off, at most
    ``top_k``, the most probable first, and with top-p the smallest such set holding ``top_p`` of
    the probability."""
    raw, processed = raw.double(), processed.double()
    kept = torch.isfinite(processed)
    n, vocab = int(kept.sum()), raw.numel()
    if settings.greedy:
        if not torch.equal(processed, raw):
            return "greedy decoding changed the logits (some logits processor ran)"
        return None
    expected = raw / settings.temperature
    if not torch.allclose(processed[kept], expected[kept], rtol=1e-4, atol=1e-4):
        ratio = (raw[kept] / processed[kept]).median().item() if n else float("nan")
        return (f"the scores are not the logits / temperature {settings.temperature:g} (logits / scores: median {ratio:.4g}; "
                "another temperature, or a penalty such as repetition_penalty)")
    if settings.top_k == 0 and settings.top_p >= 1.0:
        return None if n == vocab else f"{vocab - n} of {vocab} tokens were removed with top_k and top_p off (top-k, top-p, min-p, a suppressed token or a minimum length)"
    if settings.top_k and n > settings.top_k and not _ties_at_kth(expected, settings.top_k, n):
        return f"{n} tokens were left with top_k {settings.top_k}"
    if n < vocab and expected[kept].min() < expected[~kept].max():
        return "the tokens left are not the most probable ones"
    if settings.top_p < 1.0:
        top = expected.masked_fill(~_top_k_mask(expected, settings.top_k), -math.inf) if settings.top_k else expected
        probs = torch.softmax(top, -1)
        mass = float(probs[kept].sum())
        smallest = float(probs[kept].min())
        if mass < settings.top_p - 1e-6 or (n > 1 and mass - smallest >= settings.top_p + 1e-6):
            return f"the tokens left hold {mass:.4f} of the probability, not the smallest set holding top_p {settings.top_p:g}"
    elif settings.top_k and n < min(settings.top_k, vocab):
        return f"{n} tokens were left with top_k {settings.top_k} and top_p off"
    return None


def _top_k_mask(scores: Tensor, k: int) -> Tensor:
    kth = torch.topk(scores, min(k, scores.numel())).values[-1]
    return scores >= kth


def _ties_at_kth(scores: Tensor, k: int, n: int) -> bool:
    """More than k tokens left is right when the k-th score is tied (top-k keeps every tie)."""
    return int(_top_k_mask(scores, k).sum()) == n
