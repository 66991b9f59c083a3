"""Multi-turn, search-augmented generation: the Search-R1 protocol (PAPER.md §1), token-in/token-out.

Each turn every live rollout decodes until ``</search>``, ``</answer>``, EOS or its token budget;
then one retrieval call serves every rollout that searched, and the observation tokens are appended.
The sampled ids are kept exactly as sampled (decoding and re-encoding the model's own text can
change its tokens and so its log-probs); only observations are tokenised.

Speed on one CPU or GPU comes from three choices (issue 6 measures them):
- a group's prompt is prefilled once and its KV cache shared by its G rollouts;
- the KV cache is carried across turns: observations are appended to it, nothing is re-encoded;
- rollouts that have answered leave the batch (their cache rows are dropped) between turns.
Rows of different lengths share one cache with holes: the attention mask is 0 on the slots a row
did not use, and position ids count only the row's real tokens, so each row sees exactly the
context it would see alone.
"""
from __future__ import annotations

import functools
import inspect
import re
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import Tensor, nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from lldslight.data.example import QAExample
from lldslight.errors import require
from lldslight.policy import decoder_and_head, sampling_weights
from lldslight.retrieval.base import Passage, Retriever
from lldslight.rewards import exact_match, extract_answer, f1_score
from lldslight.trajectory import Trajectory

STOP_TAGS = ("</search>", "</answer>")
_ACTION = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
INVALID_ACTION = (
    "\nMy previous action is invalid. If I want to search, I should put the query between <search> and "
    "</search>. If I want to give the final answer, I should put the answer between <answer> and </answer>. "
    "Let me try again.\n"
)


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
        require(0 < self.top_p <= 1, "rollout.top_p", "in (0, 1]", self.top_p)
        require(self.top_k >= 0, "rollout.top_k", ">= 0 (0 = off)", self.top_k)


def format_observation(passages: list[Passage]) -> str:
    """Search-R1's ``_passages2string`` wrapped in an information block (title line kept verbatim)."""
    refs = ""
    for i, p in enumerate(passages):
        lines = p.contents.split("\n")
        refs += f"Doc {i + 1}(Title: {lines[0]}) {chr(10).join(lines[1:])}\n"
    return f"\n\n<information>{refs.strip()}</information>\n\n"


def parse_action(text: str) -> tuple[Optional[str], str]:
    """(kind, content) of the action in one turn's text, cut at the first stop tag as Search-R1 does.

    kind is "search", "answer" or None (invalid).
    """
    cut = len(text)
    for tag in STOP_TAGS:
        pos = text.find(tag)
        if pos != -1:
            cut = min(cut, pos + len(tag))
    match = _ACTION.search(text[:cut])
    if match is None:
        return None, ""
    return match.group(1), match.group(2).strip()


def prompt_token_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The prompt as the policy sees it: the chat template when the tokenizer has one."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    else:
        text = "\n".join(m["content"] for m in messages)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@dataclass
class _Row:
    example: QAExample
    prompt: list[int]
    segments: list[tuple[list[int], int]] = field(default_factory=list)  # (ids, action index or -1)
    turn: list[int] = field(default_factory=list)
    turn_logp: list[float] = field(default_factory=list)
    sample_logp: list[float] = field(default_factory=list)
    response_len: int = 0
    actions: int = 0
    searches: int = 0
    invalid: int = 0
    finish: str = ""
    stopped: bool = False


class RolloutEngine:
    """Samples Search-R1 trajectories from a policy with a retriever.

    Args:
        tokenizer: the policy's tokenizer.
        retriever: any object with ``search(queries, k) -> list[list[Passage]]``.
        reward_fn: ``(response_text, golden_answers) -> float``.
        config: sampling settings.
    """

    def __init__(self, tokenizer, retriever: Retriever, reward_fn: Callable[[str, list[str]], float], config: RolloutConfig):
        self.tokenizer = tokenizer
        self.retriever = retriever
        self.reward_fn = reward_fn
        self.config = config
        self.eos_ids = _eos_ids(tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]
        self.stats: dict[str, float] = {}

    @torch.no_grad()
    def generate(self, model: nn.Module, examples: list[QAExample], group_size: Optional[int] = None, greedy: Optional[bool] = None) -> Trajectory:
        cfg = self.config
        G = cfg.group_size if group_size is None else group_size
        greedy = cfg.greedy if greedy is None else greedy
        was_training = model.training
        model.eval()
        try:
            from lldslight.distributed import gathered_generate

            with sampling_weights(model):
                # Under FSDP2: weights gathered once for the whole batch (ranks decode different lengths).
                rows = gathered_generate(model, lambda: self._run(model, examples, G, greedy))
        finally:
            model.train(was_training)
        return self._to_trajectory(rows, next(model.parameters()).device)

    # -- decoding -------------------------------------------------------------------------------

    def _run(self, model: nn.Module, examples: list[QAExample], G: int, greedy: bool) -> list[_Row]:
        cfg = self.config
        decoder, head = decoder_and_head(model)
        device = next(model.parameters()).device

        # transformers 5.x renamed the decoder's ``past_key_values`` argument to ``cache``.
        cache_arg = "cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values"
        prompts = [prompt_token_ids(self.tokenizer, ex.messages) for ex in examples]
        rows = [_Row(example=ex, prompt=list(p)) for ex, p in zip(examples, prompts) for _ in range(G)]
        self.stats = {"decode_steps": 0, "retrieval_s": 0.0, "retrieval_calls": 0, "prefill_s": 0.0, "decode_s": 0.0, "observation_s": 0.0, "compactions": 0}
        clock = time.perf_counter()

        # Prefill each distinct prompt once (left-padded), then share its cache with its G rollouts.
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long, device=device)
        attn = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p, device=device)
            attn[i, width - len(p):] = 1
        cache = _growing_cache()
        positions = (attn.cumsum(-1) - 1).clamp(min=0)
        out = decoder(input_ids=ids, attention_mask=attn, position_ids=positions, **{cache_arg: cache}, use_cache=True)
        logits = head(out.last_hidden_state[:, -1]).float()
        if G > 1:
            cache.batch_repeat_interleave(G)
            attn = attn.repeat_interleave(G, dim=0)
            logits = logits.repeat_interleave(G, dim=0)
        next_pos = attn.sum(-1)
        live = list(range(len(rows)))  # row index of each cache slot
        clock = self._tick("prefill_s", clock, device)

        eos = set(self.eos_ids)
        for turn in range(cfg.max_turns + 1):
            final = turn == cfg.max_turns
            turn_rows = list(live)
            for r in live:
                rows[r].turn, rows[r].turn_logp, rows[r].stopped = [], [], False
            budget = {r: min(cfg.max_new_tokens, cfg.max_response_tokens - rows[r].response_len) for r in live}
            for r in live:
                if budget[r] <= 0:
                    rows[r].stopped = True
            running = sum(not rows[r].stopped for r in live)
            done: set[int] = set()  # rows whose rollout ended this turn: they may leave the batch now
            while running:
                tokens, token_logp = self._sample(logits, greedy)
                # One host transfer per step, not one per row.
                tok_list, logp_list = tokens.tolist(), token_logp.tolist()
                feed, fed = [self.pad_id] * len(live), [0] * len(live)
                for slot, r in enumerate(live):
                    row = rows[r]
                    if row.stopped:
                        continue
                    tok = tok_list[slot]
                    row.turn.append(tok)
                    row.turn_logp.append(logp_list[slot])
                    if tok in eos or len(row.turn) >= budget[r] or (tok in self._tag_closers and self._hit_stop(row.turn)):
                        row.stopped = True  # its last token is fed later, with the observation
                        running -= 1
                        if final or parse_action(self.tokenizer.decode(row.turn, skip_special_tokens=True))[0] == "answer":
                            done.add(r)
                    else:
                        feed[slot], fed[slot] = tok, 1
                if not running:
                    break
                # Rows that finished for good stop costing compute: once they are a quarter of the
                # batch, drop their cache rows (one copy of the cache, amortised over many steps).
                n_done = sum(r in done for r in live)
                if n_done and 4 * n_done >= len(live):
                    keep = [s for s, r in enumerate(live) if r not in done]
                    index = torch.tensor(keep, device=device)
                    cache.batch_select_indices(index)
                    attn, next_pos = attn[index], next_pos[index]
                    feed, fed, live = [feed[s] for s in keep], [fed[s] for s in keep], [live[s] for s in keep]
                    self.stats["compactions"] += 1
                step_ids = torch.tensor(feed, dtype=torch.long, device=device).unsqueeze(-1)
                step_mask = torch.tensor(fed, dtype=attn.dtype, device=device).unsqueeze(-1)
                attn = torch.cat([attn, step_mask], dim=1)
                pos = next_pos.unsqueeze(-1).clone()
                out = decoder(input_ids=step_ids, attention_mask=attn, position_ids=pos, **{cache_arg: cache}, use_cache=True)
                logits = head(out.last_hidden_state[:, -1]).float()
                next_pos = next_pos + step_mask[:, 0].to(next_pos.dtype)
                self.stats["decode_steps"] += 1
            clock = self._tick("decode_s", clock, device)

            # Close the turn: record the action, decide what each rollout does next.
            searches: list[tuple[int, str]] = []
            pending: dict[int, list[int]] = {}
            for r in turn_rows:
                row = rows[r]
                row.segments.append((row.turn, row.actions))
                row.sample_logp.extend(row.turn_logp)
                row.actions += 1
                row.response_len += len(row.turn)
                kind, content = parse_action(self.tokenizer.decode(row.turn, skip_special_tokens=True))
                if kind == "answer":
                    row.finish = "answer"
                elif final:
                    row.finish = "max_turns"
                elif row.response_len >= cfg.max_response_tokens:
                    row.finish = "length"
                elif kind == "search" and content:
                    searches.append((r, content))
                else:
                    row.invalid += 1
                    pending[r] = self._observation_ids(INVALID_ACTION)
            if searches:
                t0 = time.perf_counter()
                results = self.retriever.search([q for _, q in searches], cfg.topk)
                self.stats["retrieval_s"] += time.perf_counter() - t0
                self.stats["retrieval_calls"] += 1
                if len(results) != len(searches):
                    raise RuntimeError(f"retriever returned {len(results)} result lists for {len(searches)} queries")
                for (r, _), passages in zip(searches, results):
                    rows[r].searches += 1
                    pending[r] = self._observation_ids(format_observation(passages))
            for r, obs in pending.items():
                room = cfg.max_response_tokens - rows[r].response_len
                obs = obs[: max(room, 0)]
                rows[r].segments.append((obs, -1))
                rows[r].response_len += len(obs)
                if rows[r].response_len >= cfg.max_response_tokens:
                    rows[r].finish = "length"
            keep = [slot for slot, r in enumerate(live) if not rows[r].finish]
            if not keep:
                break
            if len(keep) < len(live):
                cache.batch_select_indices(torch.tensor(keep, device=device))
                attn, next_pos = attn[keep], next_pos[keep]
            live = [live[s] for s in keep]
            clock = time.perf_counter()  # retrieval and bookkeeping are not observation prefill

            # Feed each rollout's last sampled token plus its observation as one padded block.
            blocks = [[rows[r].segments[-2][0][-1]] + rows[r].segments[-1][0] for r in live]
            block_w = max(len(b) for b in blocks)
            ids = torch.full((len(live), block_w), self.pad_id, dtype=torch.long, device=device)
            block_mask = torch.zeros((len(live), block_w), dtype=attn.dtype, device=device)
            for slot, b in enumerate(blocks):
                ids[slot, : len(b)] = torch.tensor(b, device=device)
                block_mask[slot, : len(b)] = 1
            attn = torch.cat([attn, block_mask], dim=1)
            pos = next_pos.unsqueeze(-1) + (block_mask.cumsum(-1) - 1).clamp(min=0)
            out = decoder(input_ids=ids, attention_mask=attn, position_ids=pos, **{cache_arg: cache}, use_cache=True)
            lengths = block_mask.sum(-1).long()
            last = out.last_hidden_state[torch.arange(len(live), device=device), lengths - 1]
            logits = head(last).float()
            next_pos = next_pos + lengths.to(next_pos.dtype)
            clock = self._tick("observation_s", clock, device)
        for r in live:
            if not rows[r].finish:
                rows[r].finish = "max_turns"
        return rows

    def _tick(self, key: str, since: float, device: torch.device) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # kernels run asynchronously: time them, not their launch
        now = time.perf_counter()
        self.stats[key] += now - since
        return now

    def _sample(self, logits: Tensor, greedy: bool) -> tuple[Tensor, Tensor]:
        cfg = self.config
        if greedy:
            tokens = logits.argmax(-1)
            return tokens, torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0]
        scaled = logits / cfg.temperature if cfg.temperature != 1.0 else logits
        logp = torch.log_softmax(scaled, -1)
        if cfg.top_k > 0 or cfg.top_p < 1.0:
            filtered = scaled
            if cfg.top_k > 0:
                kth = torch.topk(filtered, min(cfg.top_k, filtered.shape[-1]), dim=-1).values[:, -1:]
                filtered = filtered.masked_fill(filtered < kth, float("-inf"))
            if cfg.top_p < 1.0:
                from transformers.generation.logits_process import TopPLogitsWarper

                filtered = TopPLogitsWarper(top_p=cfg.top_p)(None, filtered)
            probs = torch.softmax(filtered, -1)
        else:
            probs = logp.exp()  # the same distribution: no second softmax over the vocabulary
        # multinomial, not an exponential race: on CPU drawing one random number per vocabulary
        # entry costs more than the whole softmax (measured in benchmarks/rollout.py's notes).
        tokens = torch.multinomial(probs, 1)[:, 0]
        return tokens, logp.gather(-1, tokens[:, None])[:, 0]

    @functools.cached_property
    def _tag_closers(self) -> frozenset[int]:
        """Ids of the tokens that can complete a stop tag (their text holds its final '>'); byte
        tokens ('<0x3E>') are kept too. Only after one of these is the decoded tail searched."""
        pieces = self.tokenizer.convert_ids_to_tokens(list(range(len(self.tokenizer))))
        return frozenset(i for i, p in enumerate(pieces) if p is not None and (">" in p or p.startswith("<0x")))

    def _hit_stop(self, turn: list[int]) -> bool:
        # A tag is at most 9 characters, so the last 12 tokens always hold a freshly completed one.
        tail = self.tokenizer.decode(turn[-12:], skip_special_tokens=False)
        return any(tag in tail for tag in STOP_TAGS)

    def _observation_ids(self, text: str) -> list[int]:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids[: self.config.max_obs_tokens]

    # -- packing ----------------------------------------------------------------------------------

    def _to_trajectory(self, rows: list[_Row], device: torch.device) -> Trajectory:
        lengths = [len(r.prompt) + sum(len(s) for s, _ in r.segments) for r in rows]
        B, T = len(rows), max(lengths)
        input_ids = torch.full((B, T), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((B, T), dtype=torch.long)
        loss_mask = torch.zeros((B, T), dtype=torch.bool)
        action_id = torch.full((B, T), -1, dtype=torch.long)
        answer_mask = torch.zeros((B, T), dtype=torch.bool)
        sample_logp = torch.zeros((B, T), dtype=torch.float32)
        responses, rewards, ems, f1s = [], [], [], []
        for b, row in enumerate(rows):
            ids = list(row.prompt)
            pos = len(ids)
            for seg, act in row.segments:
                if act >= 0:
                    loss_mask[b, pos : pos + len(seg)] = True
                    action_id[b, pos : pos + len(seg)] = act
                ids.extend(seg)
                pos += len(seg)
            input_ids[b, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            attention_mask[b, : len(ids)] = 1
            model_positions = loss_mask[b].nonzero()[:, 0]
            sample_logp[b, model_positions] = torch.tensor(row.sample_logp, dtype=torch.float32)
            if row.finish == "answer":
                start = pos - len(row.segments[-1][0])
                for offset in self._answer_token_span(row.segments[-1][0]):
                    answer_mask[b, start + offset] = True
            response = self.tokenizer.decode(ids[len(row.prompt):], skip_special_tokens=True)
            responses.append(response)
            gold = row.example.golden_answers
            rewards.append(float(self.reward_fn(response, gold)))
            pred = extract_answer(response)
            ems.append(exact_match(pred, gold))
            f1s.append(f1_score(pred, gold))
        traj = Trajectory(
            input_ids=input_ids,
            attention_mask=attention_mask,
            prompt_len=torch.tensor([len(r.prompt) for r in rows], dtype=torch.long),
            loss_mask=loss_mask,
            action_id=action_id,
            answer_mask=answer_mask,
            group_id=torch.tensor([r.example.group_id for r in rows], dtype=torch.long),
            reward=torch.tensor(rewards, dtype=torch.float32),
            num_searches=torch.tensor([r.searches for r in rows], dtype=torch.long),
            num_invalid=torch.tensor([r.invalid for r in rows], dtype=torch.long),
            num_actions=torch.tensor([r.actions for r in rows], dtype=torch.long),
            finish_reason=[r.finish for r in rows],
            data_source=[r.example.data_source for r in rows],
            responses=responses,
            questions=[r.example.question for r in rows],
            golden_answers=[list(r.example.golden_answers) for r in rows],
            em=torch.tensor(ems, dtype=torch.float32),
            f1=torch.tensor(f1s, dtype=torch.float32),
            sample_logp=sample_logp,
        )
        # The ids exactly as sampled, per rollout: tests check the trajectory never re-tokenised them.
        traj.extras["sampled_ids"] = [[t for seg, act in r.segments if act >= 0 for t in seg] for r in rows]
        return traj.to(device)

    def _answer_token_span(self, action: list[int]) -> list[int]:
        """Indices of the action's tokens that overlap its last <answer>...</answer> (char offsets
        from prefix decoding, exact for any tokenizer)."""
        text = self.tokenizer.decode(action, skip_special_tokens=False)
        start = text.rfind("<answer>")
        end = text.find("</answer>", start)
        if start == -1 or end == -1:
            return []
        end += len("</answer>")
        span, prev = [], 0
        for i in range(len(action)):
            cur = len(self.tokenizer.decode(action[: i + 1], skip_special_tokens=False))
            if cur > start and prev < end:
                span.append(i)
            prev = cur
            if prev >= end:
                break
        return span


class _GrowingLayer(DynamicLayer):
    """A DynamicLayer whose keys and values live in a buffer with spare room along the sequence:
    appending a token writes into it, instead of torch.cat re-allocating and copying the whole cache
    at every step (quadratic in the length; the largest non-matmul cost of CPU decoding). The
    attention reads a view of the filled part."""

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self._kbuf = self._vbuf = None
            self._len = 0
        need = self._len + key_states.shape[-2]
        if self._kbuf is None or need > self._kbuf.shape[-2] or self._kbuf.shape[0] != key_states.shape[0]:
            self._grow(key_states, value_states, need)
        self._kbuf[:, :, self._len : need] = key_states
        self._vbuf[:, :, self._len : need] = value_states
        self._len = need
        self.keys, self.values = self._kbuf[:, :, :need], self._vbuf[:, :, :need]
        return self.keys, self.values

    def _grow(self, key_states: Tensor, value_states: Tensor, need: int) -> None:
        capacity = max(need + 64, int(need * 1.5))  # geometric: O(1) amortised copies per token
        kbuf = key_states.new_empty(key_states.shape[:2] + (capacity, key_states.shape[-1]))
        vbuf = value_states.new_empty(value_states.shape[:2] + (capacity, value_states.shape[-1]))
        if self._len:
            kbuf[:, :, : self._len] = self.keys
            vbuf[:, :, : self._len] = self.values
        self._kbuf, self._vbuf = kbuf, vbuf

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized and self._len:
            self._kbuf = self._kbuf.repeat_interleave(repeats, dim=0)
            self._vbuf = self._vbuf.repeat_interleave(repeats, dim=0)
            self.keys, self.values = self._kbuf[:, :, : self._len], self._vbuf[:, :, : self._len]

    def batch_select_indices(self, indices: Tensor) -> None:
        if self.is_initialized and self._len:
            self._kbuf, self._vbuf = self._kbuf[indices], self._vbuf[indices]
            self.keys, self.values = self._kbuf[:, :, : self._len], self._vbuf[:, :, : self._len]

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        if self.is_initialized and self.keys is not None:
            self._len = self.keys.shape[-2]

    def reset(self) -> None:
        self._kbuf = self._vbuf = None
        self._len = 0
        super().reset()


def _growing_cache():
    cache = DynamicCache()
    cache.layer_class_to_replicate = _GrowingLayer  # layers are created on first use
    return cache


def _eos_ids(tokenizer) -> list[int]:
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    for tok in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
        tid = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid is not None and tid >= 0:
            ids.add(tid)
    return sorted(ids)
