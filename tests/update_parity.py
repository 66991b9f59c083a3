"""One GRPO update on a fixed rollout batch, in one process or (run as a script) in two, for
tests/test_update.py: the update's loss and gradient must not depend on how the mini-batch is cut
into micro-batches or spread over ranks, and gradients must be reduced once per mini-batch.

    python tests/update_parity.py OUT_DIR STRATEGY [--micro-batch-size N | --micro-batch-tokens N]

loads OUT_DIR/setup.pt (the policy's weights and the rollout batch the test wrote), trains rank r
on its half of the rows (whole groups) with 2 processes under STRATEGY (ddp or fsdp2), and writes
OUT_DIR/rank{r}.pt: the gradient of the first update (every parameter, full tensors), the rank's
part of the loss, its micro-batch count and, per gradient collective (DDP's bucket all-reduce,
FSDP2's reduce-scatter), the micro-batch whose backward ran it.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import lightning.pytorch as pl
import torch

SMALL = {"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1}
LENGTHS = [27, 20, 25, 14, 28, 18, 22, 16]  # rows of different lengths: packing has work to do
ONE_ACTION = {3, 7}  # rows that answer in their first action (no observation)


def policy_config(**overrides):
    from lldslight.policy import LoRAConfig, PolicyConfig

    kw = {"gradient_checkpointing": False, **overrides}
    return PolicyConfig(model="smollm2-135m-instruct", precision="fp32", random_init=dict(SMALL), lora=LoRAConfig(r=4, alpha=8), **kw)


def make_setup(path: Path) -> dict:
    """A random-init policy whose adapter is not zero (so the reference, the adapter off, differs
    and KL has a gradient) and 8 rollouts in 4 groups: rewards (1, 0), (1, 1) -> A = 0, (0, 1),
    (1, 0); valid searches 2 1 0 1 | 3 1 2 0 (V = 1.25 over all rows, 1.0 and 1.5 per half).
    ``sample_logp`` = the policy's own log-probs + noise, so ratios are off 1 (some clipped) and
    LLDS gates open on the first update."""
    from lldslight.update.logprobs import token_logprobs
    from lldslight.policy import load_policy
    from lldslight.trajectory import Trajectory

    torch.manual_seed(0)
    model, _ = load_policy(policy_config())
    model.double()  # float64 throughout: the comparisons measure the batching, not fp32 rounding
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    B, T = len(LENGTHS), max(LENGTHS)
    ids = torch.randint(10, 1000, (B, T), generator=g)
    ids[1::2, :6] = ids[0::2, :6]  # a group's rows share their 6-token prompt (the shared-prefix forward runs)
    attn = torch.zeros(B, T, dtype=torch.long)
    action = torch.full((B, T), -1)
    answer = torch.zeros(B, T, dtype=torch.bool)
    for b, n in enumerate(LENGTHS):
        attn[b, :n] = 1
        if b in ONE_ACTION:
            action[b, 6:n] = 0
        else:
            action[b, 6:11] = 0  # first action, then a 4-token observation
            action[b, 15:n] = 1
        answer[b, n - 2 : n] = True
    traj = Trajectory(
        input_ids=ids, attention_mask=attn, prompt_len=torch.full((B,), 6), loss_mask=action >= 0,
        action_id=action, answer_mask=answer, group_id=torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]),
        reward=torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0], dtype=torch.float64),
        num_searches=torch.tensor([2, 1, 0, 1, 3, 1, 2, 0]), num_invalid=torch.zeros(B, dtype=torch.long),
        num_actions=torch.tensor([1 if b in ONE_ACTION else 2 for b in range(B)]),
        finish_reason=["answer"] * B, data_source=["t"] * B, responses=[""] * B,
    )
    with torch.no_grad():
        logp, _ = token_logprobs(model, ids, attn, traj.loss_mask)
    traj.sample_logp = (logp + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)) * traj.loss_mask
    setup = {"state": {k: v.clone() for k, v in model.state_dict().items()}, "traj": traj}
    torch.save(setup, path)
    return setup


class Feed(pl.Callback):
    """Hands the module its rows of the rollout batch (SearchRollout's job)."""

    def __init__(self, traj, rows) -> None:
        self.traj, self.rows = traj, rows

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        pl_module.rollout_batch = self.traj.select(self.rows).to(pl_module.device)


class Probe(pl.Callback):
    """Counts micro-batches (a loss term runs once per micro-batch, before its backward), notes
    which micro-batch's backward runs each gradient collective, and grabs the first update's
    gradient and loss at its step gate, which vetoes (the weights stay as they were)."""

    def __init__(self) -> None:
        self.micro = 0
        self.events: list[int] = []
        self.record: dict = {}

    def setup(self, trainer, pl_module, stage) -> None:
        pl_module.add_loss_term("probe", self.term)
        pl_module.add_step_gate("probe", self.gate)
        if trainer.world_size > 1 and type(trainer.strategy).__name__ != "DDPStrategy":
            collective = torch.distributed.reduce_scatter_single  # what FSDP2 reduces gradients with

            def counted(*args, **kwargs):
                self.events.append(self.micro)
                return collective(*args, **kwargs)

            torch.distributed.reduce_scatter_single = counted

    def on_train_start(self, trainer, pl_module) -> None:
        model = trainer.strategy.model
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            def counted(state, bucket):
                self.events.append(self.micro)
                return allreduce_hook(state, bucket)

            model.register_comm_hook(None, counted)

    def term(self, ctx) -> torch.Tensor:
        self.micro += 1
        return ctx.logp.new_zeros(())

    def gate(self, ctx) -> bool:
        if ctx.update_index == 0 and not self.record:
            from torch.distributed.tensor import DTensor

            grads = {}
            for name, p in ctx.module.named_parameters():
                if p.grad is not None:
                    g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                    grads[name] = g.detach().clone().cpu()
            self.record = {"grads": grads, "loss": float(ctx.loss), "micro_batches": self.micro, "events": list(self.events)}
        return False


def run(setup: dict, rows: list[int], strategy="auto", devices: int = 1, **module_kw) -> Probe:
    """One step of the real module on ``rows`` of the setup's rollout batch; returns the probe."""
    import warnings

    import lldslight.module
    from lldslight.callbacks import LLDS
    from lldslight.module import GRPOModule
    from lldslight.policy import load_policy

    kw = dict(lr=1e-3, updates_per_rollout=1, kl_coef=0.05, entropy_coef=0.01, old_logp_source="rollout",
              shuffle_minibatches=False, micro_batch_size=2)
    kw.update(module_kw)
    llds = LLDS(coef=0.2, skip_on_policy=False, answer_masking="official", normaliser=kw.pop("llds_normaliser", "preserving"))
    # The module takes its settings in groups: split the flat keys of these setups into them.
    from lldslight.update.optim import OptimConfig
    from lldslight.update import UpdateConfig

    optim = {k: kw.pop(k) for k in list(kw) if k in OptimConfig.__dataclass_fields__}
    update = {k: kw.pop(k) for k in list(kw) if k in UpdateConfig.__dataclass_fields__}
    module = GRPOModule(policy=policy_config(**kw.pop("policy", {})), update=UpdateConfig(**update), optim=OptimConfig(**optim), **kw)

    def load_setup_policy(config):  # configure_model's loader: the setup's weights, then sharding as usual
        model, tokenizer = load_policy(config)
        model.double().load_state_dict(setup["state"])
        return model, tokenizer

    probe = Probe()
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[Feed(setup["traj"], rows), probe, llds],
    )
    lldslight.module.load_policy = load_setup_policy
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*updates_per_rollout=1.*")
            trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader([0] * devices))
    finally:
        lldslight.module.load_policy = load_policy
    return probe


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("strategy", choices=["ddp", "fsdp2"])
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--micro-batch-tokens", type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    setup = torch.load(args.out / "setup.pt", weights_only=False)
    strategy = "ddp" if args.strategy == "ddp" else __import__("lldslight.policy.distributed", fromlist=["x"]).FSDP2Strategy()
    kw = {"micro_batch_size": args.micro_batch_size}
    if args.micro_batch_tokens:
        kw["micro_batch_tokens"] = args.micro_batch_tokens
    rank = int(__import__("os").environ.get("LOCAL_RANK", 0))
    half = len(LENGTHS) // 2
    probe = run(setup, list(range(rank * half, (rank + 1) * half)), strategy=strategy, devices=2, **kw)
    torch.save(probe.record, args.out / f"rank{rank}.pt")
