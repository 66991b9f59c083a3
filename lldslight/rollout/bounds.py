"""The sizes a user types, bounded by the model and the machine, checked before the policy loads.

- ``rollout.max_new_tokens``, ``max_obs_tokens`` and ``max_response_tokens`` against the model's
  context (``max_position_embeddings`` of its config): past it, positions have no meaning for the
  model, and decoding a 100,000-token turn would run for hours.
- Every prompt (the question in its template) plus one turn (``max_new_tokens``) against the
  context: a 1 MB question would otherwise be sent to the model whole.
- The rows of one rollout (``data.batch_size x rollout.group_size``) against the memory of the
  device that holds them: each row needs at least its KV cache over ``max_response_tokens`` and one
  decoding step's logits over the vocabulary. Only this lower bound is refused, so a run that
  might fit is never stopped; one that cannot is stopped at once, not after it filled the memory.

Everything here reads the model's config.json and tokenizer, never its weights.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional

from lldslight.errors import require
from lldslight.run.hostmem import available_memory


@dataclass(frozen=True)
class ModelShape:
    context: int  # positions (max_position_embeddings)
    vocab: int
    kv_bytes_per_token: int  # keys and values of every layer for one token
    logits_bytes: int  # one decoding step's logits (fp32)

    @classmethod
    def of(cls, config: Any, value_bytes: int) -> "ModelShape":
        text = getattr(config, "text_config", None) or config
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        return cls(context=int(text.max_position_embeddings), vocab=int(text.vocab_size),
                   kv_bytes_per_token=2 * text.num_hidden_layers * kv_heads * head_dim * value_bytes,
                   logits_bytes=4 * int(text.vocab_size))

    def row_bytes(self, response_tokens: int) -> int:
        """The least memory one rollout row takes: its KV cache over the response, one step's logits."""
        return min(response_tokens, self.context) * self.kv_bytes_per_token + self.logits_bytes


def device_memory(device: Any) -> tuple[int, str]:
    """(bytes, words) of the memory a rollout on ``device`` can use: a GPU's total, or the host's
    available memory now."""
    import torch

    if getattr(device, "type", None) == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).total_memory, f"the {device} GPU's memory"
    return available_memory(), "the memory available on this machine"


def check_lengths(rollout: Any, shape: ModelShape) -> None:
    """The rollout's token budgets fit the model's context."""
    where = f"the model's context ({shape.context} positions, max_position_embeddings of its config)"
    for key in ("max_new_tokens", "max_obs_tokens", "max_response_tokens"):
        value = getattr(rollout, key)
        require(value <= shape.context, f"rollout.{key}", f"<= {where}", value)


def check_rows(rows: int, batch: int, group: int, rollout: Any, shape: ModelShape, memory: int, words: str) -> None:
    """``rows = batch x group`` rollout rows fit ``memory``, at the least each row takes."""
    per_row = shape.row_bytes(rollout.max_response_tokens)
    most = max(1, memory // per_row)
    require(rows <= most, "rollout.group_size", f"<= {max(1, most // batch)} with data.batch_size {batch}",
            group, f"{rows} rows of a rollout need at least {rows * per_row / 2**30:.1f} GiB (a KV cache over "
                   f"max_response_tokens {rollout.max_response_tokens} and one step's logits over the {shape.vocab}-token "
                   f"vocabulary, {per_row / 2**20:.2f} MiB a row), more than the {memory / 2**30:.1f} GiB of {words}")


def check_prompts(examples: Iterable[Any], tokenizer: Any, rollout: Any, shape: ModelShape, what: str) -> None:
    """Each example's prompt plus one turn of ``max_new_tokens`` fits the context. Only prompts
    that might not fit are tokenized: a prompt has at most as many tokens as the template's own
    plus one per byte of its text (byte-level and byte-fallback tokenizers never merge less)."""
    from lldslight.rollout import prompt_token_ids

    budget = shape.context - rollout.max_new_tokens
    overhead: dict[tuple, int] = {}
    for ex in examples:
        roles = tuple(m.get("role", "") for m in ex.messages)
        if roles not in overhead:
            overhead[roles] = len(prompt_token_ids(tokenizer, [{**m, "content": ""} for m in ex.messages]))
        if overhead[roles] + sum(len(str(m.get("content", "")).encode()) for m in ex.messages) <= budget:
            continue
        n = len(prompt_token_ids(tokenizer, ex.messages))
        if n > budget:
            require(False, f"the prompt of {what} question {ex.id!r} ({ex.data_source})", f"at most {budget} tokens (the "
                    f"model's {shape.context} positions less rollout.max_new_tokens {rollout.max_new_tokens})", n,
                    f"shorten or drop the question, which starts {ex.question[:60]!r}")


def policy_shape(policy_cfg: Any) -> Optional[ModelShape]:
    """The shape of the policy ``policy_cfg`` builds, from its config.json (None for a model whose
    config says nothing of its context: the checks are skipped)."""
    from lldslight.policy.files import model_config
    from lldslight.policy.precision import resolve_precision

    config = model_config(policy_cfg)
    text = getattr(config, "text_config", None) or config
    if not getattr(text, "max_position_embeddings", None) or not getattr(text, "num_attention_heads", None):
        return None
    arith = resolve_precision(policy_cfg)
    import torch

    value_bytes = 2 if (arith.autocast or arith.frozen) in (torch.bfloat16, torch.float16) else 4
    return ModelShape.of(config, value_bytes)
