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

The reward sees only the model's own text (its actions; lldslight/rewards.py), and the answer
scored for EM/F1 is the one in its last action.
"""
from __future__ import annotations

import bisect
import contextlib
import functools
import inspect
import itertools
import re
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from lldslight.data.example import QAExample
from lldslight.policy import decoder_and_head
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


def observation_ids(tokenizer, text: str, max_obs_tokens: int) -> list[int]:
    """An observation (retrieved passages or the invalid-action message) tokenised on its own and
    cut to ``max_obs_tokens``: the rollout and the warm start both build observations here."""
    return tokenizer(text, add_special_tokens=False)["input_ids"][:max_obs_tokens]


# -- the token layout of a trajectory, shared by the rollout and the warm start (sft.py) -----------


@dataclass
class Layout:
    """One trajectory's tokens: the prompt, then segments in order, each the ids of model action
    ``action`` (0, 1, ...) or of an observation (``action`` = -1)."""

    prompt: list[int]
    segments: list[tuple[list[int], int]] = field(default_factory=list)

    def add(self, ids: list[int], action: int) -> None:
        self.segments.append((ids, action))

    def actions(self) -> list[list[int]]:
        """The model's own token ids, one list per action."""
        return [ids for ids, act in self.segments if act >= 0]

    def __len__(self) -> int:
        return len(self.prompt) + sum(len(ids) for ids, _ in self.segments)


def pack(layouts: Sequence[Layout], pad_id: int) -> dict[str, Tensor]:
    """Right-padded tensors of a batch of layouts (Trajectory's contract):
    input_ids, attention_mask [B, T] long; loss_mask [B, T] bool (model tokens);
    action_id [B, T] long (-1 off model tokens); prompt_len [B] long."""
    B, T = len(layouts), max(len(lay) for lay in layouts)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, T), dtype=torch.long)
    action_id = torch.full((B, T), -1, dtype=torch.long)
    for b, lay in enumerate(layouts):
        ids, acts = list(lay.prompt), [-1] * len(lay.prompt)
        for seg, act in lay.segments:
            ids += seg
            acts += [act] * len(seg)
        input_ids[b, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention_mask[b, : len(ids)] = 1
        action_id[b, : len(ids)] = torch.tensor(acts, dtype=torch.long)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "loss_mask": action_id >= 0,
        "action_id": action_id,
        "prompt_len": torch.tensor([len(lay.prompt) for lay in layouts], dtype=torch.long),
    }


def token_texts(tokenizer, ids: list[int]) -> list[str]:
    """The text each token adds to the decoded sequence (special tokens kept); joined, they are the
    decoded text. One batched decode when the tokens decoded one by one already concatenate to the
    whole (byte-level BPE on whole characters: the common case). Otherwise a streaming detokenizer
    (as vLLM's): each token is decoded in a small window after the tokens before it (tokenizers that
    add or drop spaces between pieces), and a token that ends inside a character (a split UTF-8
    byte) adds nothing until the one that completes it, or until 4 tokens (one UTF-8 character at
    most) have been held back."""
    decode = functools.partial(tokenizer.decode, skip_special_tokens=False)
    pieces = tokenizer.batch_decode([[t] for t in ids], skip_special_tokens=False)
    if "".join(pieces) == decode(ids):
        return pieces
    pieces, prefix, read = [], 0, 0  # ids[prefix:read] were emitted already and are kept as context
    for i in range(len(ids)):
        before, after = decode(ids[prefix:read]), decode(ids[prefix : i + 1])
        if len(after) > len(before) and (not after.endswith("\ufffd") or i + 1 - read >= 4):
            pieces.append(after[len(before):])
            prefix, read = read, i + 1
        else:
            pieces.append("")
    return pieces


def answer_token_span(tokenizer, action: list[int]) -> list[int]:
    """Indices of the action's tokens whose text overlaps its last <answer>...</answer>, in linear
    time (decoding every prefix was O(n^2): 87 ms for a 553-token action)."""
    pieces = token_texts(tokenizer, action)
    text = "".join(pieces)
    start = text.rfind("<answer>")
    end = text.find("</answer>", start)
    if start == -1 or end == -1:
        return []
    ends = list(itertools.accumulate(len(p) for p in pieces))  # ends[i]: characters up to token i
    first = bisect.bisect_right(ends, start)  # the first token reaching past `start`
    last = bisect.bisect_left(ends, end + len("</answer>"))  # the first token reaching the tag's end
    return list(range(first, last + 1))


@dataclass
class _Row:
    example: QAExample
    layout: Layout
    turn: list[int] = field(default_factory=list)
    turn_logp: list[float] = field(default_factory=list)
    sample_logp: list[float] = field(default_factory=list)
    response_len: int = 0
    actions: int = 0
    searches: int = 0
    invalid: int = 0
    finish: str = ""
    stopped: bool = False


@dataclass
class _Batch:
    """The live rows' shared decoding state. Slot s of the cache holds rows[live[s]].

    cache: per layer keys/values [S, kv_heads, L, head_dim]; slot s uses the positions where
        attn[s] is 1 (holes where other rows advanced and it did not).
    attn: [S, L] long, 1 on the cache positions a slot really uses.
    next_pos: [S] long, the position id of each slot's next token (its real length so far).
    logits: [S, V] float, each slot's next-token logits.
    """

    cache: DynamicCache
    attn: Tensor
    next_pos: Tensor
    logits: Tensor
    live: list[int]

    def keep(self, slots: list[int]) -> None:
        """Drop every slot not in ``slots`` (one copy of the cache)."""
        index = torch.tensor(slots, device=self.attn.device)
        self.cache.batch_select_indices(index)
        self.attn, self.next_pos, self.logits = self.attn[index], self.next_pos[index], self.logits[index]
        self.live = [self.live[s] for s in slots]


class RolloutEngine:
    """Samples Search-R1 trajectories from a policy with a retriever.

    Args:
        tokenizer: the policy's tokenizer.
        retriever: any object with ``search(queries, k) -> list[list[Passage]]``.
        reward_fn: ``(response, golden_answers) -> float``; ``response`` is the model's own text,
            its actions concatenated (no prompt, observation or environment message).
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

            with _lora_folded(model):
                # Under FSDP2: weights gathered once for the whole batch (ranks decode different lengths).
                rows = gathered_generate(model, lambda: self._run(model, examples, G, greedy))
        finally:
            model.train(was_training)
        return self._to_trajectory(rows, next(model.parameters()).device)

    # -- decoding -------------------------------------------------------------------------------

    def _run(self, model: nn.Module, examples: list[QAExample], G: int, greedy: bool) -> list[_Row]:
        """The rollouts of ``examples`` x G, step by step:

        1. prefill each distinct prompt once; its G rollouts share its cache rows;
        then for each turn (the last one, ``max_turns``, may not search):
        2. decode every live row until it stops (stop tag, EOS, its token budget);
        3. close the turn: record each row's action and decide: answered / out of turns or budget
           (the row ends) / searched / invalid (its observation is the invalid-action message);
        4. one retrieval call for every row that searched; the passages are its observation.
           Observations are cut to ``max_obs_tokens`` and to the response budget (a row whose
           budget they use up ends: "length");
        5. rows that ended leave the cache;
        6. prefill the observations: each row's last sampled token and its observation in one block;
        7. rows still open after the last turn end with "max_turns".
        """
        cfg = self.config
        decoder, head = decoder_and_head(model)
        # transformers 5.x renamed the decoder's ``past_key_values`` argument to ``cache``.
        cache_arg = "cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values"
        forward = lambda ids, attn, pos, cache: decoder(  # noqa: E731
            input_ids=ids, attention_mask=attn, position_ids=pos, **{cache_arg: cache}, use_cache=True
        ).last_hidden_state
        device = next(model.parameters()).device
        self.stats = {"decode_steps": 0, "retrieval_s": 0.0, "retrieval_calls": 0, "prefill_s": 0.0, "decode_s": 0.0, "observation_s": 0.0, "compactions": 0}

        clock = time.perf_counter()
        rows, batch = self._prefill_prompts(forward, head, examples, G, device)  # 1
        clock = self._tick("prefill_s", clock, device)
        for turn in range(cfg.max_turns + 1):
            final = turn == cfg.max_turns
            turn_rows = list(batch.live)
            self._decode_turn(forward, head, rows, batch, greedy, final)  # 2
            clock = self._tick("decode_s", clock, device)
            searches = [(r, q) for r in turn_rows if (q := self._close_turn(rows[r], final)) is not None]  # 3
            self._retrieve(rows, searches)  # 4
            keep = [s for s, r in enumerate(batch.live) if not rows[r].finish]  # 5
            if not keep:
                break
            if len(keep) < len(batch.live):
                batch.keep(keep)
            clock = time.perf_counter()  # retrieval and bookkeeping are not observation prefill
            self._prefill_observations(forward, head, rows, batch)  # 6
            clock = self._tick("observation_s", clock, device)
        for r in batch.live:  # 7
            if not rows[r].finish:
                rows[r].finish = "max_turns"
        return rows

    def _prefill_prompts(self, forward, head, examples: list[QAExample], G: int, device) -> tuple[list[_Row], _Batch]:
        """Step 1: each distinct prompt prefilled once (left-padded), its cache rows repeated G times."""
        prompts = [prompt_token_ids(self.tokenizer, ex.messages) for ex in examples]
        rows = [_Row(example=ex, layout=Layout(list(p))) for ex, p in zip(examples, prompts) for _ in range(G)]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long, device=device)  # [P, W]
        attn = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p, device=device)
            attn[i, width - len(p):] = 1
        cache = _growing_cache()
        hidden = forward(ids, attn, (attn.cumsum(-1) - 1).clamp(min=0), cache)  # [P, W, D]
        logits = head(hidden[:, -1]).float()  # [P, V]
        if G > 1:
            cache.batch_repeat_interleave(G)  # [P*G, kv_heads, W, head_dim] per layer
            attn = attn.repeat_interleave(G, dim=0)
            logits = logits.repeat_interleave(G, dim=0)
        return rows, _Batch(cache, attn, attn.sum(-1), logits, list(range(len(rows))))

    def _decode_turn(self, forward, head, rows: list[_Row], batch: _Batch, greedy: bool, final: bool) -> None:
        """Step 2: one token per live row per forward until every row has stopped. A stopped row
        stays in the batch (fed nothing: a hole) unless its rollout is over; those leave once they
        are a quarter of the batch (one copy of the cache, amortised over many steps)."""
        cfg = self.config
        eos = set(self.eos_ids)
        for r in batch.live:
            rows[r].turn, rows[r].turn_logp, rows[r].stopped = [], [], False
        # >= 1: a row still live has room left in its response budget
        budget = {r: min(cfg.max_new_tokens, cfg.max_response_tokens - rows[r].response_len) for r in batch.live}
        running = len(batch.live)
        done: set[int] = set()  # rows whose rollout ended this turn: they may leave the batch now
        while running:
            tokens, token_logp = self._sample(batch.logits, greedy)
            tok_list, logp_list = tokens.tolist(), token_logp.tolist()  # one host transfer per step
            feed, fed = [self.pad_id] * len(batch.live), [0] * len(batch.live)
            for slot, r in enumerate(batch.live):
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
            n_done = sum(r in done for r in batch.live)
            if n_done and 4 * n_done >= len(batch.live):
                keep = [s for s, r in enumerate(batch.live) if r not in done]
                feed, fed = [feed[s] for s in keep], [fed[s] for s in keep]
                batch.keep(keep)
                self.stats["compactions"] += 1
            step_ids = torch.tensor(feed, dtype=torch.long, device=batch.attn.device).unsqueeze(-1)  # [S, 1]
            step_mask = torch.tensor(fed, dtype=batch.attn.dtype, device=batch.attn.device).unsqueeze(-1)  # [S, 1]
            batch.attn = torch.cat([batch.attn, step_mask], dim=1)  # [S, L+1]: a hole where a row was not fed
            hidden = forward(step_ids, batch.attn, batch.next_pos.unsqueeze(-1).clone(), batch.cache)  # [S, 1, D]
            batch.logits = head(hidden[:, -1]).float()  # [S, V]
            batch.next_pos = batch.next_pos + step_mask[:, 0].to(batch.next_pos.dtype)
            self.stats["decode_steps"] += 1

    def _close_turn(self, row: _Row, final: bool) -> Optional[str]:
        """Step 3: record the turn as the row's next action and decide what follows; returns the
        query when the row searched."""
        cfg = self.config
        row.layout.add(row.turn, row.actions)
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
            return content
        else:
            row.invalid += 1
            self._observe(row, INVALID_ACTION)
        return None

    def _retrieve(self, rows: list[_Row], searches: list[tuple[int, str]]) -> None:
        """Step 4: one retrieval call for every (row, query); the passages become observations."""
        if not searches:
            return
        t0 = time.perf_counter()
        results = self.retriever.search([q for _, q in searches], self.config.topk)
        self.stats["retrieval_s"] += time.perf_counter() - t0
        self.stats["retrieval_calls"] += 1
        if len(results) != len(searches):
            raise RuntimeError(f"retriever returned {len(results)} result lists for {len(searches)} queries")
        for (r, _), passages in zip(searches, results):
            rows[r].searches += 1
            self._observe(rows[r], format_observation(passages))

    def _observe(self, row: _Row, text: str) -> None:
        """Append an observation, cut to max_obs_tokens and to what is left of the response budget."""
        room = self.config.max_response_tokens - row.response_len
        obs = observation_ids(self.tokenizer, text, self.config.max_obs_tokens)[: max(room, 0)]
        row.layout.add(obs, -1)
        row.response_len += len(obs)
        if row.response_len >= self.config.max_response_tokens:
            row.finish = "length"

    def _prefill_observations(self, forward, head, rows: list[_Row], batch: _Batch) -> None:
        """Step 6: each live row's last sampled token (never fed while decoding) plus its
        observation, as one right-padded block appended to the cache."""
        blocks = [[rows[r].layout.segments[-2][0][-1]] + rows[r].layout.segments[-1][0] for r in batch.live]
        S, width, device = len(blocks), max(len(b) for b in blocks), batch.attn.device
        ids = torch.full((S, width), self.pad_id, dtype=torch.long, device=device)  # [S, W]
        block_mask = torch.zeros((S, width), dtype=batch.attn.dtype, device=device)  # [S, W]
        for slot, b in enumerate(blocks):
            ids[slot, : len(b)] = torch.tensor(b, device=device)
            block_mask[slot, : len(b)] = 1
        batch.attn = torch.cat([batch.attn, block_mask], dim=1)  # [S, L+W]
        pos = batch.next_pos.unsqueeze(-1) + (block_mask.cumsum(-1) - 1).clamp(min=0)  # [S, W]
        hidden = forward(ids, batch.attn, pos, batch.cache)  # [S, W, D]
        lengths = block_mask.sum(-1).long()  # [S]
        batch.logits = head(hidden[torch.arange(S, device=device), lengths - 1]).float()  # [S, V]
        batch.next_pos = batch.next_pos + lengths.to(batch.next_pos.dtype)

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

    # -- packing and scoring ----------------------------------------------------------------------

    def _to_trajectory(self, rows: list[_Row], device: torch.device) -> Trajectory:
        packed = pack([row.layout for row in rows], self.pad_id)
        B, T = packed["input_ids"].shape
        answer_mask = torch.zeros((B, T), dtype=torch.bool)
        sample_logp = torch.zeros((B, T), dtype=torch.float32)
        for b, row in enumerate(rows):
            sample_logp[b, packed["loss_mask"][b]] = torch.tensor(row.sample_logp, dtype=torch.float32)
            if row.finish == "answer":
                last = row.layout.segments[-1][0]
                start = len(row.layout) - len(last)
                for offset in answer_token_span(self.tokenizer, last):
                    answer_mask[b, start + offset] = True
        scores = self._score(rows)
        traj = Trajectory(
            input_ids=packed["input_ids"],
            attention_mask=packed["attention_mask"],
            prompt_len=packed["prompt_len"],
            loss_mask=packed["loss_mask"],
            action_id=packed["action_id"],
            answer_mask=answer_mask,
            group_id=torch.tensor([r.example.group_id for r in rows], dtype=torch.long),
            reward=torch.tensor(scores["reward"], dtype=torch.float32),
            num_searches=torch.tensor([r.searches for r in rows], dtype=torch.long),
            num_invalid=torch.tensor([r.invalid for r in rows], dtype=torch.long),
            num_actions=torch.tensor([r.actions for r in rows], dtype=torch.long),
            finish_reason=[r.finish for r in rows],
            data_source=[r.example.data_source for r in rows],
            responses=scores["responses"],
            questions=[r.example.question for r in rows],
            golden_answers=[list(r.example.golden_answers) for r in rows],
            model_texts=scores["model_texts"],
            answers=scores["answers"],
            em=torch.tensor(scores["em"], dtype=torch.float32),
            f1=torch.tensor(scores["f1"], dtype=torch.float32),
            sample_logp=sample_logp,
        )
        # The ids exactly as sampled, per rollout: tests check the trajectory never re-tokenised them.
        traj.extras["sampled_ids"] = [[t for ids in r.layout.actions() for t in ids] for r in rows]
        return traj.to(device)

    def _score(self, rows: list[_Row]) -> dict[str, list]:
        """Reward, EM and F1 from the model's own words only: the reward gets the text of its actions
        (no observation, no invalid-action message); EM/F1 score the answer of its last action.
        The full response text, observations included, is kept for logging."""
        out: dict[str, list] = {k: [] for k in ("responses", "model_texts", "answers", "reward", "em", "f1")}
        decode = functools.partial(self.tokenizer.decode, skip_special_tokens=True)
        for row in rows:
            actions = [decode(ids) for ids in row.layout.actions()]
            text = "".join(actions)
            answer = extract_answer(actions[-1]) if actions else None
            gold = row.example.golden_answers
            out["responses"].append(decode([t for ids, _ in row.layout.segments for t in ids]))
            out["model_texts"].append(text)
            out["answers"].append(answer)
            out["reward"].append(float(self.reward_fn(text, gold)))
            out["em"].append(exact_match(answer, gold))
            out["f1"].append(f1_score(answer, gold))
        return out


@contextlib.contextmanager
def _lora_folded(model: nn.Module) -> Iterator[None]:
    """Sample with LoRA folded into the base weights: one matmul per layer instead of three (the
    adapter's two small matmuls cost as much as the base one at decode batch sizes).

    peft's merge_adapter/unmerge_adapter adds then subtracts the update, which leaves rounding
    drift in the frozen base (and so in the reference policy) after every rollout. Instead each
    adapted layer gets a new weight tensor W + delta while the adapter path is disabled, and the
    original tensor object is put back afterwards: exact, at the cost of one extra copy of the
    adapted weights during sampling. Skipped under FSDP2 (sharded weights; see distributed.py).
    """
    layers = [m for m in model.modules() if callable(getattr(m, "get_delta_weight", None)) and hasattr(m, "base_layer")]
    if not layers or getattr(model, "_lldslight_no_merge", False) or not callable(getattr(model, "disable_adapter", None)):
        yield
        return
    originals = []
    with model.disable_adapter():
        try:
            for layer in layers:
                weight = layer.base_layer.weight
                delta = sum(layer.get_delta_weight(name) for name in layer.active_adapters if name in layer.lora_A)
                originals.append((weight, weight.data))
                weight.data = weight.data + delta.to(weight.dtype)
            yield
        finally:
            for weight, data in originals:
                weight.data = data


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
