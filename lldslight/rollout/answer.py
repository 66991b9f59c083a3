"""From sampled token ids back to text: what text each token adds, and which of an action's
tokens spell its final ``<answer>...</answer>`` (the Trajectory's ``answer_mask``, which LLDS-MA,
``LLDS(answer_masking=...)`` in lldslight/callbacks/llds.py, weights).

Its own file because detokenising token by token is where tokenizers differ (byte-level BPE,
SentencePiece spaces, UTF-8 characters split across tokens), and the span must be exact and linear
in the action's length whatever the tokenizer; tests/test_answer_span.py covers those cases.
"""
from __future__ import annotations

import bisect
import functools
import itertools


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
