"""Build the collapse lab's policy: a small tokenizer and a small Llama, warm-started from scratch.

    python lab/make_policy.py --config lab/configs/base.yaml --out runs/lab/policy

Why: SmolLM2-135M costs ~25 s per GRPO step on 2 CPU cores, ~150 steps an hour, far too few
updates for the death spiral (docs/lab/collapse_lab.md, "An earlier single-seed run"). A model of ~1-2M weights with a
vocabulary of ~2k tokens trained on the synthetic knowledge base alone takes well under a second
per step, so thousands of optimiser updates fit in an hour. With SmolLM2's 49k vocabulary the LM
head alone would be ~6M weights, hence the tokenizer.

Everything is made here from a seed, nothing is downloaded, and every stage is cached:
1. the knowledge base of the config's ``data.synthesize`` (lldslight.data.synth);
2. ``OUT/../tokenizer``: byte-level BPE (the ``tokenizers`` library) trained on what the policy will
   read and write: every passage as an observation block, every question in the Search-R1 prompt,
   the gold actions and the invalid-action message. ``<search>``, ``</search>``, ``<answer>``,
   ``</answer>``, ``<information>``, ``</information>``, ``<think>``, ``</think>`` are single tokens
   (normal, not special: decoding keeps them); ``<|endoftext|>`` (0, unk), ``<|im_start|>`` (1, bos),
   ``<|im_end|>`` (2, eos and pad) are special, as in SmolLM2; a ChatML template without a system turn;
3. ``OUT/../base``: config.json of the Llama architecture (``--arch``) with that vocabulary, and the
   tokenizer: an untrained model directory;
4. ``OUT``: ``lldslight sft --random-init '{}' --lora-r 0`` on it (random weights from
   PolicyConfig.init_seed 0, every weight trained on gold trajectories), cached by its request.
"""
from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

from lldslight.errors import script_main

ROOT = Path(__file__).resolve().parents[1]

TAGS = ["<search>", "</search>", "<answer>", "</answer>", "<information>", "</information>", "<think>", "</think>"]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in SmolLM2
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# A Llama of ~1M weights besides the embeddings (4 layers, d=128); overridable with --arch.
DEFAULT_ARCH = {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4, "num_attention_heads": 4,
                "num_key_value_heads": 2, "max_position_embeddings": 1024}


def tokenizer_texts(kb_dir: Path, prompt_template: str | None = None) -> list[str]:
    """What the policy reads and writes, in a fixed order (the BPE merges depend on the counts only)."""
    from lldslight.data.example import make_prompt
    from lldslight.data.formats import load_examples
    from lldslight.retrieval.base import Passage
    from lldslight.rollout import INVALID_ACTION, format_observation

    texts = []
    for line in (kb_dir / "corpus.jsonl").read_text().splitlines():
        row = json.loads(line)
        texts.append(format_observation([Passage(row["id"], row["contents"])]))
    for split in ("train", "dev", "test"):
        for ex in load_examples(kb_dir / f"{split}.jsonl"):
            texts.append(make_prompt(ex.question, prompt_template) if prompt_template else ex.messages[0]["content"])
            texts += [f"<search> {t} </search>" for t in ex.meta.get("supporting_titles", [])]
            texts += [f"<answer> {a} </answer>" for a in ex.golden_answers]
    texts.append(INVALID_ACTION)
    return texts


def build_tokenizer(kb_dir: Path, out: Path, vocab_size: int, prompt_template: str | None = None) -> Path:
    """Train the BPE tokenizer and save it as a transformers tokenizer directory."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(tokenizer_texts(kb_dir, prompt_template), trainer=trainer)
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in TAGS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=SPECIAL[0], bos_token=SPECIAL[1], eos_token=SPECIAL[2],
                                   pad_token=SPECIAL[2])
    fast.chat_template = CHAT_TEMPLATE
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    return out


def build_base(tokenizer_dir: Path, out: Path, arch: dict) -> Path:
    """An untrained model directory: the architecture's config.json and the tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(vocab_size=len(tok), tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, **arch)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _digest(directory: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(directory.iterdir()):
        if p.is_file():
            h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()[:16]


def main(argv=None) -> int:
    import yaml

    from lldslight.data.synth import synthesize
    from lldslight.sft import main as sft_main

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="lab/configs/base.yaml", help="the lab recipe (its data.synthesize is the knowledge base)")
    parser.add_argument("--out", default="runs/lab/policy", help="the warm-started model directory (model.policy.model)")
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--arch", type=json.loads, default={}, help="overrides of DEFAULT_ARCH, JSON")
    parser.add_argument("--seed", type=int, default=0, help="seed of the SFT data order (the initial weights use PolicyConfig.init_seed 0)")
    parser.add_argument("--limit", type=int, default=None, help="SFT on the first N training questions (default: all)")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--force", action="store_true", help="retrain the warm start even when OUT holds it")
    args = parser.parse_args(argv)

    config = yaml.safe_load((ROOT / args.config).read_text())
    synth = dict(config["data"]["synthesize"])
    paths = synthesize(**synth)
    kb = Path(synth["out_dir"])
    rollout = next(c["init_args"]["rollout"] for c in config["trainer"]["callbacks"] if c["class_path"].endswith("SearchRollout"))
    out = Path(args.out)
    template = (config.get("data") or {}).get("prompt_template")  # the fit's prompts, so the policy learns what it will read
    tok_dir = build_tokenizer(kb, out.parent / f"{out.name}_tokenizer", args.vocab_size, template)
    base = build_base(tok_dir, out.parent / f"{out.name}_base", {**DEFAULT_ARCH, **args.arch})
    print(f"[lldslight] lab: tokenizer {tok_dir} (digest {_digest(tok_dir)}), untrained model {base}", flush=True)
    sft = ["--data", str(paths["train_jsonl"]), "--corpus", str(paths["corpus"]), "--model", str(base), "--out", str(out),
           "--random-init", "{}", "--lora-r", "0", "--seed", str(args.seed),
           "--topk", str(rollout["topk"]), "--max-obs-tokens", str(rollout["max_obs_tokens"]),
           "--max-searches", str(rollout["max_turns"]), "--over-budget", "truncate", "--keep-unanswerable",
           "--epochs", str(args.epochs), "--lr", str(args.lr), "--batch-size", str(args.batch_size)]
    if args.limit is not None:
        sft += ["--limit", str(args.limit)]
    if template is not None:
        sft += ["--prompt-template", template]
    # sft's cache key names the base directory, not its contents: retrain when those changed.
    stamp, digest = out / "lab_base_digest", _digest(base)
    if args.force or not stamp.is_file() or stamp.read_text() != digest:
        sft.append("--force")
    code = sft_main(sft)
    if code == 0:
        stamp.write_text(digest)
    return code


if __name__ == "__main__":
    raise SystemExit(script_main(main))
