"""The rollout engine: multi-turn, search-augmented generation under the Search-R1 protocol
(docs/algorithm.md §1), token-in/token-out, and its sampler; the rollouts packed into a scored
Trajectory.

Every rollout decodes a turn until ``</search>``, ``</answer>``, EOS or its token budget; then it
ends, or an observation (the retrieved passages, or the invalid-action message) is appended and it
decodes its next turn. The sampled ids are kept exactly as sampled (decoding and re-encoding the
model's own text can change its tokens and so its log-probs); only observations are tokenised.

This file owns the scheduling (which row decodes, waits for retrieval or is prefilled) and the
sampler: it is the default generation backend (backend.py). What it speaks, packs, decodes and
caches is in its siblings: episode.py (a rollout's turns under the protocol's rules, packing and
scoring, shared with every backend), protocol.py (tags, observation strings, tokenising prompts
and observations), layout.py (the token layout and packer shared with the warm start), answer.py
(detokenising, the answer span), cache.py (the ragged KV cache and the forward over it).

Speed on one CPU or GPU comes from these choices (benchmarks/generation.py measures them):
- continuous batching: each row moves through its turns on its own. A row whose turn ends is
  retrieved for in a worker thread (batched with every search queued at the time) while the others
  keep decoding, and rejoins the decode batch as soon as its observation is prefilled; finished
  rows leave the cache. No row waits for the slowest row of its turn;
- a group's prompt is prefilled once and its KV cache shared by its G rollouts;
- the KV cache is carried across turns: observations are appended to it, nothing is re-encoded;
- one ragged cache (cache.py): a row's tokens fill positions 0..length-1 of its own slot, a 4-D
  mask lets a new token see its own row's earlier tokens only, and position ids are those
  positions, so each row sees exactly the context it would see alone, with no holes to attend over;
- sampling by inverse CDF with one uniform per row from the row's own random stream (no random
  number per vocabulary entry; a row draws the same tokens whatever the scheduling around it).

The reward sees only the model's own text (its actions; lldslight/rewards.py), and the reward and
EM/F1 score one answer, the one in its last action (rewards.final_answer).
"""
from __future__ import annotations

import dataclasses
import math
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor, nn

from lldslight.data.example import QAExample
from lldslight.errors import require, require_choice
from lldslight.policy.sampling import sampling_weights
from lldslight.retrieval.base import Retriever
from lldslight.rewards import RewardFn
from lldslight.trajectory import Trajectory

from .cache import Decoder
from .compiled import CompileDecode, CompiledDecode
from .episode import Episode, EpisodeRules
from .layout import Layout
from .protocol import prompt_token_ids
from .settings import SamplingSettings
from .sync import summed_logprob


@dataclass
class RolloutConfig:
    """How rollouts are sampled.

    Args:
        group_size: G, rollouts per prompt (1 for evaluation).
        max_turns: search rounds before the final, search-free generation.
        max_new_tokens: new tokens per turn.
        max_obs_tokens: an observation is cut to this many tokens.
        max_response_tokens: budget for the whole response (model and observation tokens).
        topk: passages per search.
        temperature: sampling temperature (also used for the training log-probs).
        top_p: nucleus sampling threshold (1.0 = off).
        top_k: top-k sampling (0 = off).
        greedy: argmax decoding (evaluation).
        compile_decode: the decode step through ``torch.compile`` (compiled.py; docs/speed.md):
            "off" (eager), "on" (compiled; a failure to compile raises) or "auto" (compiled where
            it works, else eager, said once). The same tokens come out as eager's up to float
            rounding (greedy outputs tested token for token). Prefills stay eager. The first
            decode step of a process pays the compilation (minutes for a 30-layer model on a CPU).
    """

    group_size: int = 5
    max_turns: int = 3
    max_new_tokens: int = 500
    max_obs_tokens: int = 500
    max_response_tokens: int = 4096
    topk: int = 3
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False
    compile_decode: CompileDecode = "off"

    def __post_init__(self) -> None:
        # One line naming the key and its range, when the config is read (not a NaN or an autograd
        # error minutes later). group_size >= 2 for training is SearchRollout's check: evaluation uses 1.
        require(self.group_size >= 1, "rollout.group_size", ">= 1", self.group_size)
        require(self.max_turns >= 0, "rollout.max_turns", ">= 0 (search rounds before the final answer)", self.max_turns)
        require(self.max_new_tokens >= 1, "rollout.max_new_tokens", ">= 1", self.max_new_tokens)
        require(self.max_obs_tokens >= 0, "rollout.max_obs_tokens", ">= 0", self.max_obs_tokens)
        require(self.max_response_tokens >= 1, "rollout.max_response_tokens", ">= 1", self.max_response_tokens)
        require(self.topk >= 1, "rollout.topk", ">= 1", self.topk)
        if not self.greedy:
            require(self.temperature > 0, "rollout.temperature", "> 0 when sampling", self.temperature,
                    "0 divides the logits by zero; greedy decoding is rollout.greedy: true")
            require(math.isfinite(self.temperature), "rollout.temperature", "finite", self.temperature,
                    "an infinite temperature makes every token equally likely (the logits divided to 0)")
        require(0 < self.top_p <= 1, "rollout.top_p", "in (0, 1]", self.top_p)
        require(self.top_k >= 0, "rollout.top_k", ">= 0 (0 = off)", self.top_k)
        require_choice(self.compile_decode, "rollout.compile_decode", CompileDecode)


@dataclass
class _Row(Episode):
    """One rollout and its own random stream (sampling)."""

    noise: Optional[torch.Generator] = None
    _uniforms: list[float] = field(default_factory=list)

    def uniform(self) -> float:
        """The next number of the row's own uniform stream: a row samples the same tokens whatever
        the batch around it (other rows' retrieval times decide when it runs, not what it draws)."""
        if not self._uniforms:
            self._uniforms = torch.rand(256, generator=self.noise, dtype=torch.float64).tolist()[::-1]
        return self._uniforms.pop()


@dataclass
class _Slots:
    """Cache slot s holds row ``rows[s]`` with ``length[s]`` tokens; ``logits`` [S, V] are the
    slots' next-token logits (valid for the rows about to decode)."""

    rows: list[int]
    length: list[int]
    logits: Tensor


class RolloutEngine:
    """Samples Search-R1 trajectories from a policy with a retriever.

    Args:
        tokenizer (transformers.PreTrainedTokenizerBase): the policy's tokenizer.
        retriever: any object with ``search(queries, k) -> list[list[Passage]]``.
        reward_fn: ``(response, golden_answers[, question=, data_source=, turns=]) -> float``
            (rewards.RewardFn); ``response`` is the model's own text, its actions concatenated (no
            prompt, observation or environment message), a rewards.ModelText whose ``actions``
            hold each action's text.
        config: sampling settings.
    """

    def __init__(self, tokenizer, retriever: Retriever, reward_fn: RewardFn, config: RolloutConfig):
        self.tokenizer = tokenizer
        self.retriever = retriever
        self.reward_fn = reward_fn
        self.config = config
        self.rules = EpisodeRules(tokenizer, config, reward_fn)
        self.pad_id = self.rules.pad_id
        self.stats: dict[str, float] = {}
        self.compiled = CompiledDecode(config.compile_decode)  # kept across calls: it compiles once

    def sampling_settings(self, greedy: Optional[bool] = None) -> SamplingSettings:
        """What the sampler samples with: the RolloutConfig's settings, read by :meth:`sample`
        and the episode rules, and nothing else (no generation_config; settings.py)."""
        settings = SamplingSettings.configured(self.config, self.tokenizer, self.eos_ids)
        return settings if greedy is None else dataclasses.replace(settings, greedy=greedy)

    @property
    def eos_ids(self) -> list[int]:
        """The token ids that end a turn (the rules'); settable (a test ends turns on more ids)."""
        return self.rules.eos_ids

    @eos_ids.setter
    def eos_ids(self, ids: list[int]) -> None:
        self.rules.eos_ids, self.rules.eos = list(ids), frozenset(ids)

    @torch.no_grad()
    def generate(self, model: nn.Module, examples: list[QAExample], group_size: Optional[int] = None, greedy: Optional[bool] = None) -> Trajectory:
        cfg = self.config
        G = cfg.group_size if group_size is None else group_size
        greedy = cfg.greedy if greedy is None else greedy
        was_training = model.training
        model.eval()
        try:
            from lldslight.policy.distributed import gathered_generate

            with sampling_weights(model):
                # Under FSDP2: weights gathered once for the whole batch (ranks decode different lengths).
                rows = gathered_generate(model, lambda: self._run(model, examples, G, greedy))
        finally:
            model.train(was_training)
        return self.rules.to_trajectory(rows, next(model.parameters()).device)

    @torch.no_grad()
    def probe_logprob(self, model: nn.Module, ids: list[int]) -> float:
        """The summed log-prob of ``ids`` (tokens 2..n) as the sampler computes it: the prefill
        path of :meth:`generate` (sampling weights, the ragged cache's forward), raw logits. The
        weight-sync check (sync.py) compares it before and after each update."""
        was_training = model.training
        model.eval()
        try:
            from lldslight.policy.distributed import gathered_generate

            def score() -> float:
                decoder = Decoder(model)
                tokens = torch.tensor([ids], dtype=torch.long, device=decoder.device)  # [1, n]
                at = torch.arange(len(ids), device=decoder.device).unsqueeze(0)  # [1, n]
                return summed_logprob(decoder.logits(decoder(tokens, at, len(ids))[0, :-1]), tokens[0])  # logits [n-1, V]

            with sampling_weights(model):
                return gathered_generate(model, score)
        finally:
            model.train(was_training)

    # -- decoding -------------------------------------------------------------------------------

    def _run(self, model: nn.Module, examples: list[QAExample], G: int, greedy: bool) -> list[_Row]:
        """The rollouts of ``examples`` x G, with continuous batching: no row waits for another.

        Each row moves through its own turns (the first ``max_turns`` may search, the last may not):

            decode --stop--> close the turn --answer / out of turns or budget--> done
              ^                 | search                 | invalid action
              |                 v                        v
            prefill <--- observation <--- retrieval    the invalid-action message

        Retrieval runs in a worker thread while the other rows decode. Step by step:

        1. prefill each distinct prompt once; its G rollouts share its cache rows;
        then, until no row decodes and no retrieval is in flight:
        2. take the retrieval results that came back: the passages become observations (cut to
           ``max_obs_tokens`` and to the response budget; a row whose budget ends is done);
        3. send every queued search as one retrieval call, unless one is in flight;
        4. prefill the observations that are ready (each row's last sampled token and its
           observation in one block); those rows start their next turn;
        5. nothing to decode: wait for the retrieval in flight;
        6. sample one token for every decoding row; a row that stops (stop tag, EOS, its budget)
           closes its turn: done, a queued search, or the invalid-action message as observation;
        7. send the new searches (as in 3); drop finished rows from the cache once they are a
           quarter of it;
        8. one decode forward over every slot; rows not decoding write past their length (their
           next real token overwrites it) and their outputs are ignored.
        """
        decoder = Decoder(model)
        device = decoder.device
        self.stats = dict.fromkeys(
            ("decode_steps", "overlap_steps", "retrieval_s", "retrieval_wait_s", "retrieval_calls", "prefill_s", "decode_s", "observation_s", "compactions"), 0.0
        )
        clock = time.perf_counter()
        rows, slots = self._prefill_prompts(decoder, examples, G, greedy)  # 1
        clock = self._tick("prefill_s", clock, device)
        queue: list[tuple[int, str]] = []  # (row, query) not sent yet
        inflight: Optional[Future] = None
        with ThreadPoolExecutor(1, thread_name_prefix="lldslight-retrieval") as pool:

            # Deterministic mode (trainer.deterministic: true): each retrieval call is waited for
            # where it is sent, so which rows share a decode batch (and so the arithmetic of every
            # forward) depends on the step, not on how fast the search came back.
            by_step = torch.are_deterministic_algorithms_enabled()

            def send() -> None:
                nonlocal inflight, queue
                if inflight is None and queue:
                    inflight, queue = pool.submit(self._search, queue), []
                    if by_step:
                        wait([inflight])

            while True:
                if inflight is not None and inflight.done():  # 2
                    self._observe_results(rows, *inflight.result())
                    inflight = None
                send()  # 3
                ready = [s for s, r in enumerate(slots.rows) if rows[r].phase == "ready"]
                if ready:  # 4
                    clock = time.perf_counter()
                    self._prefill_observations(decoder, rows, slots, ready)
                    clock = self._tick("observation_s", clock, device)
                decoding = [s for s, r in enumerate(slots.rows) if rows[r].phase == "decode"]
                if not decoding:  # 5
                    if inflight is None:
                        break
                    t0 = time.perf_counter()
                    wait([inflight])
                    self.stats["retrieval_wait_s"] += time.perf_counter() - t0
                    continue
                clock = time.perf_counter()
                fed = self._sample_step(rows, slots, decoding, greedy, queue)  # 6
                send()  # 7
                fed = self._compact(decoder, rows, slots, fed)
                if fed:  # 8
                    self._decode_forward(decoder, slots, fed)
                    self.stats["overlap_steps"] += inflight is not None and not inflight.done()
                # no device sync: sampling the next token waits for this step anyway
                self.stats["decode_s"] += time.perf_counter() - clock
        return rows

    def _prefill_prompts(self, decoder: "Decoder", examples: list[QAExample], G: int, greedy: bool) -> tuple[list[_Row], "_Slots"]:
        """Step 1: every distinct prompt prefilled in one right-padded forward; each prompt's cache
        row and logits repeated for its G rollouts. Each sampled row gets its own random stream,
        seeded from torch's global generator (so ``torch.manual_seed`` fixes every rollout)."""
        prompts = [prompt_token_ids(self.tokenizer, ex.messages) for ex in examples]
        seeds = [None] * (len(prompts) * G) if greedy else torch.randint(2**62, (len(prompts) * G,)).tolist()
        pairs = [(ex, p) for ex, p in zip(examples, prompts) for _ in range(G)]
        rows = [_Row(ex, Layout(list(p)), noise=None if seed is None else torch.Generator().manual_seed(seed)) for (ex, p), seed in zip(pairs, seeds)]
        P, width, device = len(prompts), max(len(p) for p in prompts), decoder.device
        ids = torch.full((P, width), self.pad_id, dtype=torch.long, device=device)  # [P, W]
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p, device=device)
        at = torch.arange(width, device=device).expand(P, width)  # [P, W]
        hidden = decoder(ids, at, width)  # [P, W, D]
        last = torch.tensor([len(p) - 1 for p in prompts], device=device)
        logits = decoder.logits(hidden[torch.arange(P, device=device), last])  # [P, V]
        if G > 1:
            decoder.cache.repeat_rows(G)  # [P*G, kv_heads, C, head_dim] per layer
            logits = logits.repeat_interleave(G, dim=0)
        for row in rows:
            self.rules.start_turn(row)
        return rows, _Slots(rows=list(range(len(rows))), length=[len(p) for p in prompts for _ in range(G)], logits=logits)

    def _sample_step(self, rows: list[_Row], slots: "_Slots", decoding: list[int], greedy: bool, queue: list[tuple[int, str]]) -> dict[int, int]:
        """Step 6: one token for every decoding slot; returns {slot: token} for the rows that go on
        (a row's stopping token is fed later, with its observation)."""
        logits = slots.logits
        if len(decoding) < len(slots.rows):
            logits = logits[torch.tensor(decoding, device=logits.device)]  # [B, V]
        u = None if greedy else torch.tensor([rows[slots.rows[s]].uniform() for s in decoding], device=logits.device)
        tokens, token_logp = self.sample(logits, u)
        fed = {}
        for s, tok, logp in zip(decoding, tokens.tolist(), token_logp.tolist()):  # one host transfer
            row = rows[slots.rows[s]]
            row.turn.append(tok)
            row.turn_logp.append(logp)
            if self.rules.turn_stops(row, tok):
                query = self.rules.close_turn(row)
                if query is not None:
                    queue.append((slots.rows[s], query))
            else:
                fed[s] = tok
        return fed

    def _search(self, searches: list[tuple[int, str]]) -> tuple[list[tuple[int, str]], list, float]:
        """One retrieval call (in the worker thread)."""
        t0 = time.perf_counter()
        results = self.retriever.search([q for _, q in searches], self.config.topk)
        return searches, results, time.perf_counter() - t0

    def _observe_results(self, rows: list[_Row], searches: list[tuple[int, str]], results: list, seconds: float) -> None:
        """Step 2: the passages of a finished retrieval call become the rows' observations."""
        self.stats["retrieval_s"] += seconds
        self.stats["retrieval_calls"] += 1
        if len(results) != len(searches):
            raise RuntimeError(f"retriever returned {len(results)} result lists for {len(searches)} queries")
        for (r, _), passages in zip(searches, results):
            self.rules.observe_passages(rows[r], passages)

    def _prefill_observations(self, decoder: "Decoder", rows: list[_Row], slots: "_Slots", ready: list[int]) -> None:
        """Step 4: for the ``ready`` slots only, each row's last sampled token (never fed while
        decoding) and its observation as one right-padded block written at the row's length."""
        blocks = [[rows[r].layout.segments[-2][0][-1]] + rows[r].layout.segments[-1][0] for r in (slots.rows[s] for s in ready)]
        B, width, device = len(blocks), max(len(b) for b in blocks), decoder.device
        ids = torch.full((B, width), self.pad_id, dtype=torch.long, device=device)  # [B, W]
        for i, b in enumerate(blocks):
            ids[i, : len(b)] = torch.tensor(b, device=device)
        index = torch.tensor(ready, device=device)
        at = torch.tensor([slots.length[s] for s in ready], device=device).unsqueeze(-1) + torch.arange(width, device=device)  # [B, W]
        kv_len = max(slots.length[s] for s in ready) + width
        hidden = decoder(ids, at, kv_len, rows=None if B == len(slots.rows) else index)  # [B, W, D]
        last = torch.tensor([len(b) - 1 for b in blocks], device=device)
        slots.logits[index] = decoder.logits(hidden[torch.arange(B, device=device), last])  # [B, V]
        for s, b in zip(ready, blocks):
            slots.length[s] += len(b)
            row = rows[slots.rows[s]]
            row.turn_index += 1
            self.rules.start_turn(row)

    def _compact(self, decoder: "Decoder", rows: list[_Row], slots: "_Slots", fed: dict[int, int]) -> dict[int, int]:
        """Step 7: finished rows leave the cache once they are a quarter of it (one copy of the
        cache, amortised over many steps); returns ``fed`` renumbered to the new slots."""
        done = sum(rows[r].phase == "done" for r in slots.rows)
        if not done or 4 * done < len(slots.rows):
            return fed
        keep = [s for s, r in enumerate(slots.rows) if rows[r].phase != "done"]
        index = torch.tensor(keep, dtype=torch.long, device=decoder.device)
        decoder.cache.keep_rows(index)
        slots.logits = slots.logits[index]
        slots.rows, slots.length = [slots.rows[s] for s in keep], [slots.length[s] for s in keep]
        self.stats["compactions"] += 1
        renumber = {s: i for i, s in enumerate(keep)}
        return {renumber[s]: tok for s, tok in fed.items()}

    def _decode_forward(self, decoder: "Decoder", slots: "_Slots", fed: dict[int, int]) -> None:
        """Step 8: one token per slot at its length: the fed rows' sampled tokens (the others' pad
        lands where their next real token will be written)."""
        device = decoder.device
        feed = [fed.get(s, self.pad_id) for s in range(len(slots.rows))]
        ids = torch.tensor(feed, dtype=torch.long, device=device).unsqueeze(-1)  # [S, 1]
        at = torch.tensor(slots.length, device=device).unsqueeze(-1)  # [S, 1]
        slots.logits = self.compiled(decoder, ids, at, max(slots.length) + 1)  # [S, V]: valid on the fed slots (others refill at prefill)
        for s in fed:
            slots.length[s] += 1
        self.stats["decode_steps"] += 1

    def _tick(self, key: str, since: float, device: torch.device) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # kernels run asynchronously: time them, not their launch
        now = time.perf_counter()
        self.stats[key] += now - since
        return now

    def sample(self, logits: Tensor, u: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        """(tokens [B], their log-probs [B]) from logits [B, V]: the argmax when ``u`` is None, else
        by inverse CDF: the first token whose cumulative probability exceeds u [B] (one uniform per
        row, from its own stream). One exp and one in-place cumulative sum over the vocabulary:
        no log-softmax copy, and no random number per vocabulary entry (torch.multinomial draws an
        exponential per entry). Log-probs are of the temperature-scaled softmax; top-k/top-p only
        restrict which tokens can be drawn."""
        cfg = self.config
        if u is None:
            tokens = logits.argmax(-1)
            return tokens, logits.gather(-1, tokens[:, None])[:, 0] - torch.logsumexp(logits, -1)
        scaled = logits / cfg.temperature if cfg.temperature != 1.0 else logits
        top = scaled.amax(-1, keepdim=True)  # [B, 1]
        weights = (scaled - top).exp_()  # [B, V] unnormalised probabilities
        if cfg.top_k > 0 or cfg.top_p < 1.0:
            log_z = weights.sum(-1).log()
            filtered = scaled
            if cfg.top_k > 0:
                kth = torch.topk(filtered, min(cfg.top_k, filtered.shape[-1]), dim=-1).values[:, -1:]
                filtered = filtered.masked_fill(filtered < kth, float("-inf"))
            if cfg.top_p < 1.0:
                from transformers.generation.logits_process import TopPLogitsWarper

                filtered = TopPLogitsWarper(top_p=cfg.top_p)(None, filtered)
            cdf = (filtered - top).exp_().cumsum_(-1)  # [B, V]
        else:
            cdf = weights.cumsum_(-1)  # [B, V], in place
            log_z = cdf[:, -1].log()
        total = cdf[:, -1:]  # [B, 1]
        # strictly below the total, so some entry exceeds it; that entry's own weight is > 0
        x = torch.minimum(u[:, None].to(cdf.dtype) * total, torch.nextafter(total, torch.zeros_like(total)))
        tokens = torch.searchsorted(cdf, x, right=True)[:, 0]
        return tokens, scaled.gather(-1, tokens[:, None])[:, 0] - top[:, 0] - log_z
