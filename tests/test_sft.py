"""The supervised warm start: gold trajectories laid out as the rollout lays them out, a loss that
falls, and a saved model that `model.policy.model` loads and that then follows the protocol."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from conftest import tiny_policy_config


def _one_hop(examples):
    return [e for e in examples if e.meta.get("type") == "1hop"]


def test_gold_turns_search_titles_then_answer(synth_kb, bm25):
    from lldslight.data.formats import load_examples
    from lldslight.rollout import parse_action
    from lldslight.sft import GoldConfig, gold_turns

    examples = load_examples(synth_kb["train_jsonl"])
    one_hop = _one_hop(examples)[0]
    pieces = gold_turns(one_hop, bm25, GoldConfig(topk=2, max_searches=1))
    assert [is_model for _, is_model in pieces] == [True, False, True]
    assert parse_action(pieces[0][0]) == ("search", one_hop.meta["supporting_titles"][0])
    assert pieces[1][0].lstrip().startswith("<information>Doc 1(Title: ") and "Doc 2(Title: " in pieces[1][0]
    assert parse_action(pieces[2][0]) == ("answer", one_hop.golden_answers[0])

    two_hop = next(e for e in examples if e.meta.get("type") == "2hop")
    assert gold_turns(two_hop, bm25, GoldConfig(max_searches=1)) is None
    pieces = gold_turns(two_hop, bm25, GoldConfig(topk=1, max_searches=2, require_answer_in_context=False))
    searches = [parse_action(t)[1] for t, is_model in pieces if is_model][:-1]
    assert searches == two_hop.meta["supporting_titles"]


def test_gold_requires_the_answer_in_context(synth_kb, bm25):
    from lldslight.data.formats import load_examples
    from lldslight.sft import GoldConfig, gold_turns

    example = _one_hop(load_examples(synth_kb["train_jsonl"]))[0]
    example.golden_answers = ["Zzyzx Nowhere 9999"]
    assert gold_turns(example, bm25, GoldConfig(topk=1, max_searches=1)) is None
    kept = gold_turns(example, bm25, GoldConfig(topk=1, max_searches=1, require_answer_in_context=False))
    assert kept[-1][0] == "<answer> Zzyzx Nowhere 9999 </answer>"


def test_question_is_the_query_without_supporting_titles(synth_kb, bm25):
    from lldslight.data.formats import load_examples
    from lldslight.sft import gold_queries

    example = load_examples(synth_kb["train_jsonl"])[0]
    example.meta.pop("supporting_titles")
    assert gold_queries(example) == [example.question]


def test_encoding_matches_the_rollout_layout(synth_kb, bm25, tiny_policy):
    from lldslight.data.formats import load_examples
    from lldslight.rollout import prompt_token_ids
    from lldslight.sft import GoldConfig, build_gold_set, encode_gold, gold_turns, pad_batch

    _, tok = tiny_policy
    examples = load_examples(synth_kb["train_jsonl"])[:12]
    cfg = GoldConfig(topk=3, max_obs_tokens=20, max_searches=1)
    example = _one_hop(examples)[0]
    pieces = gold_turns(example, bm25, cfg)
    layout = encode_gold(example, pieces, tok, cfg)
    prompt = prompt_token_ids(tok, example.messages)
    search = tok(pieces[0][0], add_special_tokens=False)["input_ids"]
    answer = tok(pieces[2][0], add_special_tokens=False)["input_ids"]
    obs = tok(pieces[1][0], add_special_tokens=False)["input_ids"][:20]
    assert layout.prompt == prompt
    assert layout.segments == [(search, 0), (obs, -1), (answer, 1)]
    packed = pad_batch([layout], tok.pad_token_id)
    assert packed["input_ids"][0].tolist() == prompt + search + obs + answer
    assert packed["loss_mask"][0].tolist() == [False] * len(prompt) + [True] * len(search) + [False] * len(obs) + [True] * len(answer)
    assert packed["action_id"][0].tolist() == [-1] * len(prompt) + [0] * len(search) + [-1] * len(obs) + [1] * len(answer)

    rows, stats = build_gold_set(examples, bm25, tok, cfg)
    assert stats["kept"] == len(rows) == stats["examples"] - stats["too_many_searches"] - stats["answer_not_retrieved"]
    assert stats["too_many_searches"] > 0  # 2-hop and comparison questions need two searches
    batch = pad_batch(rows, tok.pad_token_id)
    lengths = torch.tensor([len(r) for r in rows])
    assert torch.equal(batch["attention_mask"].sum(-1), lengths)
    assert batch["loss_mask"].sum() == sum(len(ids) for r in rows for ids in r.actions())


def test_gold_layout_is_what_the_rollout_samples(protocol_model, protocol_examples, bm25):
    """The warm start and the rollout share one packer: where the protocol model (trained on these
    gold trajectories) writes the gold actions, its greedy rollout packs into the gold's tensors,
    position for position (prompt, observation cut, masks, action ids)."""
    from lldslight.rewards import ExactMatchReward
    from lldslight.rollout import RolloutConfig, RolloutEngine
    from lldslight.sft import GoldConfig, build_gold_set, pad_batch

    model, tok = protocol_model
    gold_cfg = GoldConfig(topk=1, max_searches=1, end_with_eos=True)
    gold, _ = build_gold_set(protocol_examples, bm25, tok, gold_cfg)
    for layout in gold:  # the rollout stops at </answer>: the EOS the gold appends is never sampled
        layout.segments[-1][0].pop()
    engine = RolloutEngine(tok, bm25, ExactMatchReward(), RolloutConfig(group_size=1, greedy=True, topk=1, max_turns=1, max_new_tokens=24, max_obs_tokens=gold_cfg.max_obs_tokens, max_response_tokens=600))
    traj = engine.generate(model, protocol_examples)
    same = [b for b in range(len(gold)) if gold[b].actions() == _actions(traj, b)]
    assert same, "the fixture model should reproduce at least one gold trajectory"
    packed = pad_batch([gold[b] for b in same], tok.pad_token_id)
    rollout = traj.select(same)
    for key in ("input_ids", "attention_mask", "loss_mask", "action_id", "prompt_len"):
        assert torch.equal(getattr(rollout, key), packed[key]), key


def _actions(traj, b):
    """Row b's model tokens, one list per action."""
    ids, acts = traj.input_ids[b].tolist(), traj.action_id[b].tolist()
    return [[t for t, a in zip(ids, acts) if a == k] for k in range(int(traj.num_actions[b]))]


def test_warm_start_learns_saves_and_loads(synth_kb, bm25, tmp_path):
    from lldslight.data.formats import load_examples
    from lldslight.policy import PolicyConfig, load_policy
    from lldslight.sft import GoldConfig, build_gold_set, pad_batch, sft_loss, warm_start

    examples = _one_hop(load_examples(synth_kb["train_jsonl"]))[:8]
    # Every weight trains here: a random 2-layer model's logits stay near uniform under LoRA alone
    # (the tied embedding and the final norm are frozen); the CLI test below covers LoRA merging.
    policy = tiny_policy_config(lora=False)
    gold = GoldConfig(topk=1, max_obs_tokens=48, max_searches=1)
    summary = warm_start(examples, bm25, tmp_path / "ws", policy, gold, epochs=10, batch_size=4, lr=3e-3, accelerator="cpu")
    assert summary["kept"] == 8 and summary["steps"] == 20

    # The saved directory is a plain HF model (adapter merged) that the policy loader takes as is.
    meta = json.loads((tmp_path / "ws" / "lldslight_export.json").read_text())
    assert meta["warm_start"]["kept"] == 8
    trained, tok = load_policy(PolicyConfig(model=str(tmp_path / "ws"), precision="fp32", lora=None, gradient_checkpointing=False))
    initial, _ = load_policy(tiny_policy_config(lora=False))
    batch = pad_batch(build_gold_set(examples, bm25, tok, gold)[0], tok.pad_token_id)
    with torch.no_grad():
        before, after = sft_loss(initial, batch).item(), sft_loss(trained, batch).item()
    assert after < 0.5 * before, (before, after)


def test_sft_command_is_idempotent_and_reports_empty_sets(synth_kb, tmp_path, capsys):
    from conftest import TINY_DIMS
    from lldslight.sft import main

    out = tmp_path / "ws"
    args = ["--data", str(synth_kb["train_jsonl"]), "--corpus", str(synth_kb["corpus"]), "--out", str(out),
            "--random-init", json.dumps(TINY_DIMS), "--topk", "1", "--max-searches", "1", "--lora-r", "4"]
    assert main(args + ["--limit", "0"]) == 2
    assert "lldslight sft: error: sft: none of 0 examples" in capsys.readouterr().err
    assert not out.exists()
    missing = [a if a != str(synth_kb["train_jsonl"]) else str(tmp_path / "nope.jsonl") for a in args]
    assert main(missing + ["--limit", "6"]) == 2
    assert f"{tmp_path / 'nope.jsonl'}: no such file" in capsys.readouterr().err

    assert main(args + ["--limit", "6"]) == 0
    from safetensors.torch import load_file

    assert not [k for k in load_file(out / "model.safetensors") if "lora" in k]  # the adapter is merged
    first = (out / "model.safetensors").stat().st_mtime_ns
    assert json.loads((out / "lldslight_export.json").read_text())["request"]["limit"] == 6
    assert main(args + ["--limit", "6"]) == 0
    assert "already holds this warm start" in capsys.readouterr().out
    assert (out / "model.safetensors").stat().st_mtime_ns == first
    assert main(args + ["--limit", "5"]) == 0  # a different request trains again
    second = (out / "model.safetensors").stat().st_mtime_ns
    assert second != first
    # The same paths holding other data (a knowledge base re-synthesised in place) train again.
    data = Path(synth_kb["train_jsonl"])
    data.write_text(data.read_text())
    os.utime(data, ns=(second + 10**9, second + 10**9))
    assert main(args + ["--limit", "5"]) == 0
    assert "already holds" not in capsys.readouterr().out
    assert (out / "model.safetensors").stat().st_mtime_ns != second


def test_sft_precision_flag_and_warm_starts_made_under_dtype_stay_cached(synth_kb, tmp_path, capsys, recwarn):
    """--precision replaces --dtype: no deprecation warning by default; a warm start recorded by
    the old default (--dtype float32) is still recognised; bf16-mixed saves bfloat16 weights."""
    from safetensors import safe_open

    from conftest import TINY_DIMS
    from lldslight.sft import main

    out = tmp_path / "ws"
    args = ["--data", str(synth_kb["train_jsonl"]), "--corpus", str(synth_kb["corpus"]), "--out", str(out), "--limit", "4",
            "--random-init", json.dumps(TINY_DIMS), "--topk", "1", "--max-searches", "1", "--lora-r", "4"]
    assert main(args) == 0
    assert not [str(w.message) for w in recwarn if "policy.dtype is deprecated" in str(w.message)]
    marker = out / "lldslight_export.json"
    meta = json.loads(marker.read_text())
    assert meta["request"]["policy"]["precision"] == "fp32" and meta["request"]["policy"]["dtype"] is None
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float32}
    meta["request"]["policy"]["dtype"] = "float32"  # as the old default wrote it
    marker.write_text(json.dumps(meta))
    capsys.readouterr()
    assert main(args) == 0
    assert "already holds this warm start" in capsys.readouterr().out

    assert main(args + ["--precision", "bf16-mixed"]) == 0  # another arithmetic: trained again
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
