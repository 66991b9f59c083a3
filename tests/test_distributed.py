"""Two processes on CPU (gloo), launched by Lightning itself from the real CLI: DDP and FSDP2 train
exactly like one process on the same global batch.

Each rank samples its own prompts, so the two runs cannot simply be compared step by step with a
one-process run of the same config. Instead the two-process run records, per step and rank, the
trajectories it trained on (with the prompts and RNG state before sampling); a one-process run then
trains on the union of both ranks' trajectories (ordered so each global mini-batch is the union of
the ranks' mini-batches; ``shuffle_minibatches: false``). Per-step metrics (loss, KL, grad norm,
max ratio, ...) and final weights must agree: they would not if gradients were not averaged over
ranks, if the optimiser stepped on unsynchronised or wrongly sharded weights, or if metrics were
reduced the wrong way across ranks (e.g. a max averaged). Step 2's trajectories were sampled by
the two-process policy after step 1, so a divergence there shows up as well. The one-process
replay also re-samples step 1 from each rank's prompts and RNG state with the unsharded policy and
requires the same tokens: sampling under sharding is the same sampling.
"""
from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
STEPS = 2
ROLLOUT = "{group_size: 2, max_turns: 2, max_new_tokens: 12, max_obs_tokens: 48, max_response_tokens: 120, topk: 2, temperature: 1.0}"
RETRIEVER = """
          class_path: lldslight.retrieval.BM25Retriever
          init_args: {corpus: .lldslight/tiny_data/corpus.jsonl}"""
MODEL = """
model:
  update:
    shuffle_minibatches: false
    grad_clip: 0.05   # small enough to clip: exercises clipping of sharded gradients
"""
MULTI = """
trainer:
  devices: 2
  max_steps: {steps}
  strategy: {strategy}
  callbacks:
    - class_path: run_helpers.RecordRollouts
      init_args: {{out_dir: {rec}}}
    - class_path: lldslight.callbacks.SearchRollout
      init_args:
        retriever:{retriever}
        reward: {{class_path: run_helpers.ParityReward}}
        rollout: {rollout}
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {{save_last: true}}
"""
REPLAY = """
trainer:
  devices: 1
  max_steps: {steps}
  callbacks:
    - class_path: run_helpers.ReplayRollouts
      init_args:
        record_dir: {rec}
        world_size: 2
        chunks: 2
        verify_generation: true
        retriever:{retriever}
        rollout: {rollout}
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {{save_last: true}}
"""
COMPARED = ("train/loss", "train/pg_loss", "train/kl", "train/grad_norm", "train/grad_norm_max", "train/ratio_max",
            "train/entropy", "train/clip_frac", "train/reward", "train/zero_var_groups", "train/lr")


def run_fit(tmp: Path, name: str, body: str, in_process: bool = False, extra: tuple[str, ...] = (), save_dir: Path | None = None) -> Path:
    """`lldslight fit` on the tiny config plus ``body`` (and ``extra`` arguments); returns the run's
    log directory. The two-process runs are subprocesses (Lightning's launcher starts the second
    rank itself); the one-process replay runs in this process, one thread like the others (saves a
    start-up)."""
    cfg = tmp / f"{name}.yaml"
    cfg.write_text(body + MODEL)
    save_dir = save_dir or tmp / name
    args = ["fit", "--config", "configs/tiny.yaml", "--config", str(cfg), "--trainer.logger.init_args.save_dir", str(save_dir), *extra]
    if in_process:
        from lldslight.cli import main

        threads, cwd = torch.get_num_threads(), os.getcwd()
        torch.set_num_threads(1)
        os.chdir(ROOT)
        try:
            assert main(args) == 0
        finally:
            torch.set_num_threads(threads)
            os.chdir(cwd)
        return save_dir / "tiny" / "version_0"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "tests"), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "lldslight.cli", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stderr[-4000:]}"
    return max((save_dir / "tiny").glob("version_*"), key=lambda p: int(p.name.split("_")[1]))


def metrics(run: Path) -> dict[int, dict[str, float]]:
    with open(run / "metrics.csv") as f:
        return {int(r["step"]): {k: float(v) for k, v in r.items() if v} for r in csv.DictReader(f) if r.get("train/loss")}


def weights(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]


def check_same_training(multi: Path, single: Path, rec: Path) -> None:
    # Groups never straddle ranks: every prompt's G rollouts were sampled by one rank.
    for step in range(STEPS):
        g0, g1 = (torch.load(rec / f"step{step}_rank{r}.pt", weights_only=False)["traj"].group_id for r in (0, 1))
        assert not set(g0.tolist()) & set(g1.tolist()), f"step {step}: a group is on both ranks"
        assert all(int((g0 == g).sum()) == 2 for g in g0.unique()), "a rank holds an incomplete group"
    want, got = metrics(single), metrics(multi)
    assert sorted(want) == sorted(got) == list(range(STEPS))
    assert any(0 < want[s]["train/reward"] < 1 for s in want), "no mixed-reward group: the check would be vacuous"
    assert all(want[s]["train/grad_norm"] > 0 for s in want)
    for step in range(STEPS):
        for key in COMPARED:
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-4, abs=1e-6), (step, key, got[step][key], want[step][key])
    a, b = weights(multi), weights(single)
    assert a.keys() == b.keys() and all("lora_" in k for k in a)
    moved = max(float(v.abs().max()) for k, v in b.items() if "lora_B" in k)
    assert moved > 1e-4, "the adapter barely moved: the weight comparison would be vacuous"
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_ddp_two_processes_match_one_process(tmp_path, capfd):
    rec = tmp_path / "rec"
    fmt = dict(rec=rec, retriever=RETRIEVER, rollout=ROLLOUT, steps=STEPS)
    multi = run_fit(tmp_path, "ddp", MULTI.format(strategy="ddp", **fmt))
    single = run_fit(tmp_path, "single", REPLAY.format(**fmt), in_process=True)
    assert "reproduced token for token" in capfd.readouterr().out
    check_same_training(multi, single, rec)


@pytest.mark.slow
def test_fsdp2_two_processes_match_one_process_and_checkpoint_loads_anywhere(tmp_path, capfd):
    from transformers import AutoModelForCausalLM

    from lldslight.policy.export import main as export_main
    from lldslight.module import GRPOModule

    rec = tmp_path / "rec"
    fmt = dict(rec=rec, retriever=RETRIEVER, rollout=ROLLOUT, steps=STEPS)
    multi = run_fit(tmp_path, "fsdp", MULTI.format(strategy="{class_path: lldslight.policy.distributed.FSDP2Strategy}", **fmt))
    single = run_fit(tmp_path, "single", REPLAY.format(**fmt), in_process=True)
    assert "reproduced token for token" in capfd.readouterr().out
    check_same_training(multi, single, rec)

    # The FSDP2 checkpoint (one file, assembled on rank 0) loads in one process ...
    ckpt = multi / "checkpoints" / "last.ckpt"
    module = GRPOModule.load_from_checkpoint(ckpt).eval()
    state = module.state_dict()
    for k, v in weights(single).items():
        torch.testing.assert_close(state[k], v, rtol=1e-4, atol=1e-6)
    # ... and exports to a plain transformers directory with the adapter merged.
    assert export_main(["--ckpt", str(ckpt), "--out", str(tmp_path / "hf")]) == 0
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        merged = hf(input_ids=ids).logits
        trained = module.policy(input_ids=ids).logits
        with module.policy.disable_adapter():
            base = module.policy(input_ids=ids).logits
    torch.testing.assert_close(merged, trained, rtol=1e-4, atol=1e-5)
    assert float((merged - base).abs().max()) > 1e-3, "the export lost the adapter"


def test_fsdp1_strategy_is_refused_with_a_pointer_to_fsdp2():
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

    from lldslight.policy.distributed import FSDP2Strategy, fsdp2_strategy_check

    with pytest.raises(ValueError, match="FSDP2Strategy"):
        fsdp2_strategy_check(FSDPStrategy())
    fsdp2_strategy_check(DDPStrategy())
    fsdp2_strategy_check(FSDP2Strategy())


FULL_FT = ("--model.policy.lora", "null", "--model.update.kl_coef", "0.05", "--model.optim.lr", "1e-3")


@pytest.mark.slow
def test_fsdp2_full_finetuning_with_a_reference_model_resumes_bit_for_bit(tmp_path):
    """The paper's recipes: full fine-tuning under FSDP2 with a separate frozen reference model
    (KL on). Three steps in one go vs two steps, then a restart from the checkpoint for the third:
    the same metrics and final weights, bit for bit."""
    fmt = dict(rec=tmp_path / "rec", retriever=RETRIEVER, rollout=ROLLOUT, strategy="{class_path: lldslight.policy.distributed.FSDP2Strategy}")

    def body(steps: int) -> str:
        # A checkpoint after every step (mid-epoch): the one saved when max_steps ends an unfinished
        # epoch makes Lightning start the next epoch on resume, with another prompt order.
        return MULTI.format(steps=steps, **fmt).replace("{save_last: true}", "{save_last: true, every_n_train_steps: 1}")

    whole = run_fit(tmp_path, "whole", body(3), extra=FULL_FT)
    part = run_fit(tmp_path, "part", body(2), extra=FULL_FT)
    resumed = run_fit(tmp_path, "resumed", body(3), extra=(*FULL_FT, "--ckpt_path", "last"), save_dir=part.parents[1])
    assert resumed != part, "the resumed run logs to a new version directory"
    want, got = metrics(whole), {**metrics(part), **metrics(resumed)}
    assert sorted(want) == sorted(got) == [0, 1, 2] and sorted(metrics(resumed)) == [2]
    assert any(0 < want[s]["train/reward"] < 1 for s in want), "no mixed-reward group: the check would be vacuous"
    assert want[2]["train/kl"] > 0, "the policy should have moved away from the frozen reference"
    for step in want:
        keys = {k for k in want[step] if k.startswith("train/")}
        assert keys == {k for k in got[step] if k.startswith("train/")}
        for key in sorted(keys):
            assert got[step][key] == want[step][key], (step, key, got[step][key], want[step][key])
    a, b = weights(whole), weights(resumed)
    assert a.keys() == b.keys() and a and all(k.startswith("policy.") and "lora_" not in k for k in a), sorted(a)[:5]
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.slow
def test_fsdp2_with_a_param_dtype_trains(tmp_path):
    """FSDP2's mixed precision (``model.fsdp.param_dtype``, every Qwen2.5 FSDP2 recipe sets it)
    re-creates dataclass arguments on their way into each layer; the shared-prefix layout's count of
    split attention calls must survive that (it read 0 and the first step failed)."""
    rec = tmp_path / "rec"
    fmt = dict(rec=rec, retriever=RETRIEVER, rollout=ROLLOUT, steps=STEPS)
    run = run_fit(tmp_path, "fsdp_dtype", MULTI.format(strategy="{class_path: lldslight.policy.distributed.FSDP2Strategy}", **fmt),
                  extra=("--model.fsdp.param_dtype", "float32"))
    steps = metrics(run)
    assert sorted(steps) == list(range(STEPS)) and all(s["train/grad_norm"] > 0 for s in steps.values())
