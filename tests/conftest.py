"""Shared fixtures: the repo's paths, a tiny real model, a synthetic knowledge base with BM25."""
from __future__ import annotations

import importlib
import os
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"
PROTOCOL_TRAIN_STEPS = 80
TINY_DIMS = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}

torch.set_num_threads(min(2, os.cpu_count() or 1))


# The longest files first: pytest-xdist (--dist loadfile) hands files out in collection order, so a
# long file collected last would run alone at the end while the other workers idle. The vLLM files
# (a server start and a protocol-trained model: ~6 minutes on one 2-core worker) are the longest.
LONGEST_FIRST = ("test_vllm.py", "test_bench_vllm.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: every other file keeps its order


def load_benchmark(name: str) -> ModuleType:
    """A script under benchmarks/ imported as the module ``benchmarks.<name>``, to test its pieces."""
    return importlib.import_module(f"benchmarks.{name}")


def load_lab(name: str) -> ModuleType:
    """A script under lab/ imported as the module ``lab.<name>``, to test its pieces."""
    return importlib.import_module(f"lab.{name}")


def shared_data(*parts: str) -> Path:
    """A file under ../shared/data, or a clean skip when the shared folder is absent."""
    path = SHARED_DATA.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"public test data not present: {path}")
    return path


@pytest.fixture(scope="session")
def synth_kb(tmp_path_factory) -> dict:
    from lldslight.data.synth import synthesize

    out = tmp_path_factory.mktemp("synthkb")
    return synthesize(out, seed=0, entities=60, dev=6, test=6)


@pytest.fixture(scope="session")
def bm25(synth_kb):
    from lldslight.retrieval import BM25Retriever

    return BM25Retriever(corpus=str(synth_kb["corpus"]), show_progress=False)


def tiny_policy_config(lora: bool = True):
    from lldslight.policy import LoRAConfig, PolicyConfig

    return PolicyConfig(
        model="smollm2-135m-instruct",
        precision="fp32",
        random_init=dict(TINY_DIMS),
        lora=LoRAConfig(r=4, alpha=8) if lora else None,
        gradient_checkpointing=False,
    )


@pytest.fixture(scope="session")
def tiny_policy():
    """A random-init 2-layer model with SmolLM2's real tokenizer (LoRA on)."""
    from lldslight.policy import load_policy

    return load_policy(tiny_policy_config())


@pytest.fixture(scope="session")
def protocol_examples(synth_kb):
    """A few 1-hop synthetic questions (with the entity to search for)."""
    from lldslight.data.formats import load_examples

    examples = [e for e in load_examples(synth_kb["train_jsonl"]) if e.meta.get("type") == "1hop"][:3]
    for gid, e in enumerate(examples):
        e.group_id = gid
        # A short prompt keeps the trained fixture cheap; the exact Search-R1 text is tested apart.
        e.messages = [{"role": "user", "content": f"Search, then answer. Question: {e.question}"}]
    return examples


@pytest.fixture(scope="session")
def protocol_model(protocol_examples, bm25):
    """A tiny model *trained* (plain cross-entropy, a few seconds) to follow the protocol on a few
    questions: search the entity, read the information block, answer. Real weights, real
    tokenizer: the rollout's search, observation and answer paths all run for real."""
    return train_protocol_model(protocol_examples, bm25, tiny_policy_config(lora=False))


def train_protocol_model(protocol_examples, bm25, config):
    """The policy of ``config`` trained to follow the protocol (protocol_model's recipe; tests/test_vllm.py
    trains one whose attention heads vLLM's CPU kernels take)."""
    from lldslight.policy import load_policy
    from lldslight.sft import GoldConfig, build_gold_set, pad_batch, sft_loss

    model, tok = load_policy(config)
    torch.manual_seed(0)
    rows, stats = build_gold_set(protocol_examples, bm25, tok, GoldConfig(topk=1, max_searches=1, end_with_eos=True))
    assert stats["kept"] == len(protocol_examples), stats
    batch = pad_batch(rows, tok.pad_token_id)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(PROTOCOL_TRAIN_STEPS):
        loss = sft_loss(model, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return model, tok
