"""The sampling settings a backend uses (lldslight/rollout/settings.py): printed when training
starts, checked against the config, whatever the model's generation_config says.

- The check of what ``generate`` did to a step's logits, against transformers' own logits
  processors: each processor the settings do not name is seen, and the ones they name pass.
- A model whose generation_config disagrees with the config (temperature 0.3, top_k 5, top_p 0.5,
  an epsilon cutoff, repetition_penalty 1.3, min_new_tokens 4): both backends sample from the configured
  distribution (their log-probs against a from-scratch forward at temperature 1; tokens far below
  the top 5 drawn), HFGenerate's generate sees none of it, and the model keeps its config.
- Through the CLI, with that model saved as a Hugging Face directory: the start prints the settings
  used and names the generation_config's as not used; a backend that reports other settings than
  the config's is refused at the start, one line.
"""
from __future__ import annotations

import pytest
import torch
import yaml
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper,
    TopPLogitsWarper,
)

from lldslight.rollout import HFGenerate, RolloutConfig, RolloutEngine, SamplingSettings
from lldslight.rollout.settings import processed_scores_mismatch, unused_generation_config
from tests.conftest import ROOT, tiny_policy_config

# epsilon_cutoff 3e-4 leaves only the likeliest token of a random model's flat distribution: sampled
# with it, every token would be the argmax.
DISAGREEING = dict(do_sample=True, temperature=0.3, top_k=5, top_p=0.5, epsilon_cutoff=3e-4, repetition_penalty=1.3, min_new_tokens=4)


def settings(**kw) -> SamplingSettings:
    base = dict(greedy=False, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=8, max_response_tokens=64, stop=("</answer>",))
    return SamplingSettings(**{**base, **kw})


def apply(processors, raw: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    scores = raw[None].clone()
    for processor in processors:
        scores = processor(seen[None], scores)
    return scores[0]


def test_the_check_sees_every_processor_the_settings_do_not_name():
    gen = torch.Generator().manual_seed(0)
    raw = torch.randn(1000, generator=gen) * 3  # [V] logits of one step
    seen = torch.cat([raw.topk(3).indices, torch.randint(1000, (17,), generator=gen)])  # the context's ids, the likeliest among them
    plain = settings()
    assert processed_scores_mismatch(raw, raw.clone(), plain) is None
    eos_held_back = MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=20, min_new_tokens=4, eos_token_id=7)
    for extra in (TemperatureLogitsWarper(0.3), TopKLogitsWarper(5), TopPLogitsWarper(0.5), RepetitionPenaltyLogitsProcessor(1.3),
                  eos_held_back):
        assert processed_scores_mismatch(raw, apply([extra], raw, seen), plain) is not None, type(extra).__name__
    # the settings' own processors, as transformers applies them, pass; one step off does not
    named = settings(temperature=0.7, top_k=50, top_p=0.9)
    exact = [TemperatureLogitsWarper(0.7), TopKLogitsWarper(50), TopPLogitsWarper(0.9)]
    assert processed_scores_mismatch(raw, apply(exact, raw, seen), named) is None
    for wrong in ([TemperatureLogitsWarper(0.8), TopKLogitsWarper(50), TopPLogitsWarper(0.9)],
                  [TemperatureLogitsWarper(0.7), TopKLogitsWarper(5), TopPLogitsWarper(0.9)],  # top-p alone would keep more
                  [TemperatureLogitsWarper(0.7), TopKLogitsWarper(50), TopPLogitsWarper(0.8)],
                  [RepetitionPenaltyLogitsProcessor(1.05), *exact]):  # processors run before the warpers
        assert processed_scores_mismatch(raw, apply(wrong, raw, seen), named) is not None
    assert processed_scores_mismatch(raw, apply([TopKLogitsWarper(5)], raw, seen), settings(top_k=5)) is None
    # greedy: no processor at all
    assert processed_scores_mismatch(raw, raw.clone(), settings(greedy=True)) is None
    assert processed_scores_mismatch(raw, apply([RepetitionPenaltyLogitsProcessor(1.3)], raw, seen), settings(greedy=True)) is not None


@pytest.fixture
def disagreeing_model(tiny_policy, monkeypatch):
    """tiny_policy (LoRA) whose base model's generation_config says otherwise than the config."""
    model, tok = tiny_policy
    base = model.get_base_model()
    monkeypatch.setattr(base, "generation_config", GenerationConfig(**DISAGREEING))
    return model, tok


def rank_of_sampled(model, traj) -> torch.Tensor:
    """For each sampled model token, how many tokens had a higher logit: from a from-scratch
    forward of the whole row (no cache, no sampler)."""
    ranks = []
    with torch.no_grad():
        for b in range(len(traj)):
            n = int(traj.attention_mask[b].sum())
            ids = traj.input_ids[b, :n][None]
            logits = model(input_ids=ids).logits[0, :-1].float()  # [n-1, V]
            at = traj.loss_mask[b, 1:n].nonzero()[:, 0]
            chosen = logits[at].gather(-1, ids[0, 1:][at, None])
            ranks.append((logits[at] > chosen).sum(-1))
    return torch.cat(ranks)


def logp_from_scratch(model, traj) -> torch.Tensor:
    """Each sampled token's log-prob at temperature 1 from a plain forward, [tokens]."""
    out = []
    with torch.no_grad():
        for b in range(len(traj)):
            n = int(traj.attention_mask[b].sum())
            ids = traj.input_ids[b, :n][None]
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double(), -1)
            at = traj.loss_mask[b, 1:n].nonzero()[:, 0]
            out.append(logp[at].gather(-1, ids[0, 1:][at, None])[:, 0])
    return torch.cat(out)


@pytest.mark.parametrize("backend", [RolloutEngine, HFGenerate])
def test_both_backends_sample_as_configured_whatever_the_generation_config_says(backend, disagreeing_model, protocol_examples, bm25):
    model, tok = disagreeing_model
    config = RolloutConfig(group_size=2, greedy=False, temperature=1.0, top_p=1.0, top_k=0, max_turns=1, max_new_tokens=6,
                           max_obs_tokens=16, max_response_tokens=40)
    engine = backend(tok, bm25, lambda text, gold: 0.0, config)
    assert engine.sampling_settings() == SamplingSettings.configured(config, tok, engine.rules.eos_ids)
    torch.manual_seed(0)
    model.eval()
    traj = engine.generate(model, protocol_examples)
    sampled = traj.loss_mask[:, 1:]
    ranks = rank_of_sampled(model, traj)
    # a random model's distribution is nearly flat: at top_k 5 every token would rank < 5, with the
    # epsilon cutoff every one would be the argmax
    assert (ranks >= 5).float().mean() > 0.5, ranks
    got = traj.sample_logp[:, 1:][sampled].double()
    assert torch.allclose(got, logp_from_scratch(model, traj), atol=1e-4)  # temperature 1, no penalty
    assert model.get_base_model().generation_config.temperature == 0.3  # the model keeps its own config


def save_disagreeing_model(path) -> None:
    """tiny.yaml's random model as a Hugging Face directory, with a generation_config that says
    otherwise than the config."""
    from lldslight.policy import load_policy

    model, tok = load_policy(tiny_policy_config(lora=False))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    GenerationConfig(**DISAGREEING).save_pretrained(path)


def fit_config(tmp_path, backend: str) -> str:
    config = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    config["model"]["policy"] = {"model": str(tmp_path / "model"), "precision": "fp32", "lora": {"r": 4, "alpha": 8}}
    rollout = config["trainer"]["callbacks"][0]
    rollout["init_args"]["backend"] = backend
    config["trainer"]["callbacks"] = [rollout]
    (tmp_path / "fit.yaml").write_text(yaml.safe_dump(config))
    return str(tmp_path / "fit.yaml")


def test_the_start_prints_the_settings_used_and_what_of_the_generation_config_is_not(tmp_path, monkeypatch, capsys):
    from lldslight.cli import main

    save_disagreeing_model(tmp_path / "model")
    monkeypatch.chdir(tmp_path)
    assert main(["fit", "--config", fit_config(tmp_path, "lldslight.rollout.HFGenerate"), "--trainer.max_steps", "1"]) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[lldslight] sampling")]
    assert line.startswith("[lldslight] sampling (HFGenerate): temperature 1, top_p 1, top_k off, max_new_tokens 12 per turn, "
                           "max_response_tokens 120, stop '</search>', '</answer>', '<|im_end|>'")
    assert line.endswith("; the model's generation_config (do_sample True, temperature 0.3, top_p 0.5, top_k 5, "
                         "epsilon_cutoff 0.0003, repetition_penalty 1.3, min_new_tokens 4) is not used")
    assert unused_generation_config(torch.nn.Linear(1, 1)) == {}  # a module with no generation_config


class ServerDefaults(RolloutEngine):
    """A backend that reports the sampling settings of a server started with its model's defaults
    (temperature 0.7, top_p 0.8), not those of the RolloutConfig it is built with."""

    def sampling_settings(self, greedy=None):
        import dataclasses

        return dataclasses.replace(super().sampling_settings(greedy), temperature=0.7, top_p=0.8)


def test_a_backend_sampling_otherwise_than_the_config_is_refused_at_the_start(tmp_path, capsys):
    from tests.test_bad_input import run_cli

    config = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    config["trainer"]["callbacks"][0]["init_args"]["backend"] = "tests.test_sampling_settings.ServerDefaults"
    (tmp_path / "fit.yaml").write_text(yaml.safe_dump(config))
    code, err = run_cli(["fit", "--config", str(tmp_path / "fit.yaml"), "--trainer.max_steps", "1"], tmp_path, capsys)
    assert code == 2, err
    (line,) = err.strip().splitlines()[-1:]
    assert line.startswith("lldslight fit: error: SearchRollout.backend ServerDefaults does not sample as configured "
                           "(temperature: samples with 0.7, rollout config says 1.0; top_p: samples with 0.8, rollout config says 1.0)")
    assert not (tmp_path / "runs" / "tiny" / "version_0" / "metrics.csv").exists()  # refused before the first step
