"""The ragged KV cache of one rollout batch and the forward that reads it.

Every rollout of a batch has its own cache slot, its tokens at positions 0..length-1 of that slot
(left-aligned, no holes). A forward names the slots that take part and where each new token goes;
a 4-D mask lets a token see its own row's earlier tokens only, and the position ids are those
positions, so each row sees exactly the context it would see alone. This is what lets the engine
(engine.py) batch rows that are at different turns and lengths, carry the cache across turns
(observations are appended, nothing is re-encoded) and share one prefilled prompt between a
group's G rollouts.

Its own file because the cache layout and the mask are one invariant, held against the Hugging
Face decoder's cache interface (``DynamicCache``: ``update``, ``get_seq_length``) and its two
attention implementations (sdpa, eager). The engine is their user; the speed tools
(benchmarks/decode_ops.py) measure them directly, through ``lldslight.rollout``.
"""
from __future__ import annotations

import inspect
from typing import Optional

import torch
from torch import Tensor, nn
from transformers import DynamicCache

from lldslight.errors import require
from lldslight.policy.load import decoder_and_head


class RaggedCache(DynamicCache):
    """The KV cache of one rollout batch: per layer, keys and values in buffers
    [S, kv_heads, C, head_dim] (S slots, capacity C), slot s holding its row's tokens at positions
    0..length-1 (left-aligned, no holes: each row attends over its own length only). Before a
    forward the engine sets which slots take part (``rows``, None = all) and where each new token
    goes (``at``: [B, q] positions, also its position ids); a row's padding tokens write past its
    length, where its next real tokens overwrite them. A buffer grows geometrically (O(1) amortised
    copies per token), never by concatenating at every step."""

    def __init__(self) -> None:
        super().__init__()
        self.k: list[Tensor] = []  # per layer: [S, kv_heads, C, head_dim]
        self.v: list[Tensor] = []  # per layer: [S, kv_heads, C, head_dim]
        self.rows: Optional[Tensor] = None  # [B] slots of the next forward (None = all S)
        self.at: Optional[Tensor] = None  # [B, q] positions of its new tokens
        self.kv_len = 0
        self.capacity = 0
        self._every_slot: Optional[Tensor] = None  # [S]: the slots, when a forward writes them all

    def prepare(self, at: Tensor, rows: Optional[Tensor], kv_len: int) -> None:
        """Set up the next forward: keys 0..kv_len-1 (kv_len > every position in ``at``; the
        engine knows it on the host, so no device sync)."""
        self.at, self.rows, self.kv_len = at, rows, kv_len
        if self.kv_len > self.capacity:
            self.capacity = max(self.kv_len + 64, int(self.kv_len * 1.5))
            # Grown here, before the forward, not inside ``update``: a compiled decode step
            # (compiled.py) then sees buffers of a fixed capacity and only writes into them.
            self.k, self.v = [self._grown(k) for k in self.k], [self._grown(v) for v in self.v]
        if rows is None and self.k and (self._every_slot is None or len(self._every_slot) != self.k[0].shape[0]):
            self._every_slot = torch.arange(self.k[0].shape[0], device=self.k[0].device)  # one per slot count

    def buffers(self, key_states: Tensor, value_states: Tensor, layer_idx: int) -> tuple[Tensor, Tensor]:
        """Layer ``layer_idx``'s key and value buffers [S, kv_heads, C, head_dim], allocated at its
        first forward (S = that forward's rows: the prefill's); :meth:`prepare` grows them."""
        if layer_idx == len(self.k):
            shape = (key_states.shape[0], key_states.shape[1], self.capacity, key_states.shape[-1])
            self.k.append(key_states.new_zeros(shape))
            self.v.append(value_states.new_zeros(shape))
        return self.k[layer_idx], self.v[layer_idx]

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs) -> tuple[Tensor, Tensor]:
        # key_states, value_states: [B, kv_heads, q, head_dim] for the slots in self.rows
        k, v = self.buffers(key_states, value_states, layer_idx)
        # Written by index_put, not scatter_: on this CPU torch 2.13's bf16 scatter_ takes ~20x as
        # long as index_put at the decode shape (206 us against 9.6 us per call at 8 slots, 1 thread;
        # fp32 5.3 vs 9.1 us; benchmarks/decode_ops.py, docs/lab/speed.md).
        if self.rows is not None:
            rows = self.rows  # [B]
        else:  # every slot: one arange per slot count (prepare), not one per layer and step
            if self._every_slot is None:  # the first forward: the buffers were allocated just now
                self._every_slot = torch.arange(k.shape[0], device=k.device)
            rows = self._every_slot
        k[rows[:, None], :, self.at] = key_states.transpose(1, 2)  # indexed as [B, q, kv_heads, head_dim]
        v[rows[:, None], :, self.at] = value_states.transpose(1, 2)
        if self.rows is None:  # every slot: attend over views (no copy)
            return k[:, :, : self.kv_len], v[:, :, : self.kv_len]
        return k[self.rows, :, : self.kv_len], v[self.rows, :, : self.kv_len]  # copies: [B, kv_heads, kv_len, head_dim]

    def _grown(self, buf: Tensor) -> Tensor:
        # [S, kv_heads, C_old, head_dim] -> [S, kv_heads, C, head_dim], the old positions copied
        out = buf.new_zeros(buf.shape[:2] + (self.capacity, buf.shape[-1]))
        out[:, :, : buf.shape[2]] = buf
        return out

    def repeat_rows(self, repeats: int) -> None:
        # [P, ...] -> [P * repeats, ...]: each prompt's slot repeated for its group
        self.k = [k.repeat_interleave(repeats, dim=0) for k in self.k]
        self.v = [v.repeat_interleave(repeats, dim=0) for v in self.v]

    def keep_rows(self, index: Tensor) -> None:
        # index: [S'] slots kept, in order; [S, ...] -> [S', ...]
        self.k = [k[index] for k in self.k]
        self.v = [v[index] for v in self.v]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.kv_len


class Decoder:
    """The policy's decoder and LM head over a ragged cache: new tokens at explicit positions, with
    the 4-D mask that lets each see its own row's earlier tokens and nothing else."""

    def __init__(self, model: nn.Module) -> None:
        self.decoder, self.head = decoder_and_head(model)
        impl = getattr(getattr(model, "config", None), "_attn_implementation", "sdpa")
        require(impl in (None, "sdpa", "eager"), "policy.attn_implementation", "'sdpa' or 'eager' for the rollout engine",
                impl, "its ragged cache gives each row its own 4-D attention mask; another attention runs with "
                "SearchRollout's backend: lldslight.rollout.HFGenerate (docs/generation_backends.md)")
        self.additive_mask = impl == "eager"  # eager adds the mask to the scores; sdpa takes a boolean one
        # transformers 5.x renamed the decoder's ``past_key_values`` argument to ``cache``.
        self.cache_arg = "cache" if "cache" in inspect.signature(self.decoder.forward).parameters else "past_key_values"
        embeddings = model.get_input_embeddings().weight  # the hidden states' dtype (weights may be packed 4-bit)
        self.device, self.dtype = embeddings.device, embeddings.dtype
        self.cache = RaggedCache()

    def __call__(self, ids: Tensor, at: Tensor, kv_len: int, rows: Optional[Tensor] = None) -> Tensor:
        """ids, at: [B, q] token ids and their positions in slots ``rows`` (None = every slot);
        kv_len: one more than the largest position. Returns the last hidden states [B, q, D]."""
        self.cache.prepare(at, rows, kv_len)
        return self.forward_prepared(ids, at, kv_len)

    def forward_prepared(self, ids: Tensor, at: Tensor, kv_len: int) -> Tensor:
        """:meth:`__call__` after ``self.cache.prepare(at, rows, kv_len)``: the part a compiled
        decode step runs (compiled.py); the cache's buffers are not resized in it."""
        keys = torch.arange(kv_len, device=self.device)  # [kv_len]
        mask = keys.view(1, 1, -1) <= at.unsqueeze(-1)  # [B, q, kv_len]: its row's tokens up to itself
        if self.additive_mask:
            mask = torch.zeros(mask.shape, dtype=self.dtype, device=self.device).masked_fill_(~mask, torch.finfo(self.dtype).min)
        out = self.decoder(input_ids=ids, attention_mask=mask.unsqueeze(1), position_ids=at, **{self.cache_arg: self.cache}, use_cache=True)
        return out.last_hidden_state

    def logits(self, hidden: Tensor) -> Tensor:
        # hidden: [..., D] -> float32 logits [..., V]
        return self.head(hidden).float()
