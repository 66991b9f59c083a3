#!/usr/bin/env bash
# One GRPO step on one H200: a random-init Qwen2.5-1.5B-shaped model (bf16, LoRA r=16, gradient
# checkpointing), 64 prompts x G=5, 3 search turns then the answer, 128 new tokens per turn.
# Prints rollout tokens/s, step time split, peak GPU memory and model FLOPs utilisation, as a table
# last. Self-contained: it needs only PyTorch, transformers, peft and lightning (no demo model
# package, no network) and this repository; it finishes in well under 8 minutes on an H200.
#
#   bash benchmarks/gpu.sh --prepare   # where the demo model is, once: copy the tokenizer + config it
#                                      # needs into benchmarks/.gpu_assets (git-ignored: copy it along)
#   bash benchmarks/gpu.sh             # on the GPU machine (STEPS=2 measured steps after a warm-up)
#   SMOKE=1 bash benchmarks/gpu.sh     # anywhere: a tiny model on CPU, to check the script runs
#   BACKEND=vllm bash benchmarks/gpu.sh                   # rollouts from a vLLM server lldslight starts
#   BACKEND=vllm VLLM_MODE=inprocess bash benchmarks/gpu.sh   # vllm.LLM in this process (vLLM installed here)
#
# BACKEND=vllm: lldslight.rollout.VLLMGenerate. The server runs from VLLM_PYTHON (default
# .venv-vllm/bin/python: `LLDSLIGHT_VLLM_SPEC=vllm bash scripts/setup_vllm.sh` installs the CUDA build
# there), taking VLLM_GPU_MEMORY (default 0.3) of the GPU beside the trainer. vLLM loads weights
# from a folder, so the random model is saved once and the policy loaded from it. The adapter push
# and the weight-sync probe run after each step ("weight push + probe" row, outside the step time).
#
# The model is random: it never emits a valid <search>, so every turn ends in an invalid action
# and gets the Search-R1 "invalid action" observation, a fixed-size block prefilled into the cache.
# That is the same work per turn as a retrieval observation, minus the retrieval call itself (which
# benchmarks/retrieval.py measures). Rows run to the token budget: 151,936-way random sampling
# rarely hits EOS, so the work per step is fixed.
set -euo pipefail
cd "$(dirname "$0")/.."
ASSETS=benchmarks/.gpu_assets
PY=${PYTHON:-$(command -v python3 || command -v python)}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && [ "${1:-}" = "--prepare" ] && PY=.venv/bin/python

if [ "${1:-}" = "--prepare" ]; then
  "$PY" - "$ASSETS" <<'EOF'
import shutil, sys
from pathlib import Path
from lldslight.policy import PolicyConfig, resolve_model_dir
src, out = Path(resolve_model_dir(PolicyConfig())), Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
    if (src / name).exists():
        shutil.copy(src / name, out / name)
print(f"tokenizer + config copied to {out}: copy it to the GPU machine with the repository")
EOF
  exit 0
fi

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
exec "$PY" - "$ASSETS" <<'EOF'
import os, sys, time
from pathlib import Path

import torch
import lightning.pytorch as pl

from lldslight.callbacks.rollout import SearchRollout
from lldslight.data.example import QAExample, make_prompt
from lldslight.module import GRPOModule
from lldslight.update.optim import OptimConfig
from lldslight.update import UpdateConfig
from lldslight.policy import LoRAConfig, PolicyConfig
from lldslight.retrieval.base import Passage
from lldslight.rollout import RolloutConfig

smoke = os.environ.get("SMOKE") == "1"
assets = Path(sys.argv[1])
if not (assets / "config.json").exists():
    from lldslight.policy import resolve_model_dir
    try:
        assets = Path(resolve_model_dir(PolicyConfig()))
    except Exception as err:  # no demo model here: the assets must have been carried
        sys.exit(f"need {assets}: run 'bash benchmarks/gpu.sh --prepare' on a machine with lldslight's demo model, then copy it here ({err})")
cuda = torch.cuda.is_available() and not smoke
if not cuda and not smoke:
    sys.exit("no CUDA device: run on the GPU machine, or SMOKE=1 for the CPU check")

# Qwen2.5-1.5B's shape on the Llama layout of the demo config (Qwen2 = Llama + q/k/v bias).
QWEN15 = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
              num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_parameters={"rope_theta": 1e6, "rope_type": "default"},
              attention_bias=True, tie_word_embeddings=True)
TINY = dict(QWEN15, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
vllm = os.environ.get("BACKEND", "engine") == "vllm"
if vllm:  # vLLM's CPU attention takes heads of 32 and more
    TINY.update(num_attention_heads=2, num_key_value_heads=1)
N_PROMPTS, G, TURNS, NEW, OBS = (64, 5, 3, 128, 128) if not smoke else (4, 2, 3, 8, 32)
STEPS = int(os.environ.get("STEPS", "2" if not smoke else "1"))
PEAK_TFLOPS = 989.0  # H200 SXM dense bf16 (spec sheet); measured matmul ceiling here ~790

torch.manual_seed(0)
torch.backends.cuda.matmul.allow_tf32 = True
examples = [
    QAExample(id=str(i), question=f"Which city hosted event number {i} of the series?", golden_answers=["x"],
              data_source="bench", messages=[{"role": "user", "content": make_prompt(f"Which city hosted event number {i} of the series")}], group_id=i)
    for i in range(N_PROMPTS)
]


class Passages:
    def search(self, queries, k):
        return [[Passage(id=str(j), contents=f"Title {j}\n" + "Some text about the event. " * 10, score=1.0) for j in range(k)] for _ in queries]


class Prompts(torch.utils.data.IterableDataset):
    def __iter__(self):
        while True:
            yield examples


class Data(pl.LightningDataModule):
    def train_dataloader(self):
        return torch.utils.data.DataLoader(Prompts(), batch_size=None)


records = []


class AfterStep(pl.Callback):
    """Last in the callback list: the time SearchRollout spent after the step (weight push + probe)."""
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if cuda:
            torch.cuda.synchronize()
        records[-1]["sync_s"] = time.perf_counter() - timer.t_end
class Timer(pl.Callback):
    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if cuda:
            torch.cuda.synchronize()
        traj = module.last_rollout
        real = traj.attention_mask.sum().item()
        model_tokens = traj.loss_mask.sum().item()
        prompt_tokens = traj.prompt_len.sum().item()
        self.t_end = time.perf_counter()
        records.append(dict(
            step_s=self.t_end - self.t0,
            rollout_s=module.timings["rollout_s"], logprob_s=module.timings["logprob_s"], update_s=module.timings["update_s"],
            model_tokens=model_tokens, obs_tokens=real - model_tokens - prompt_tokens, prompt_tokens=prompt_tokens,
            all_tokens=real, rows=len(traj), max_len=traj.attention_mask.sum(-1).max().item(),
            peak_gb=torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"),
        ))


policy_kw = dict(model=str(assets), random_init=TINY if smoke else QWEN15, dtype="bfloat16" if cuda else "float32")
backend_kw = {}
if vllm:
    import functools, tempfile
    from lldslight.policy import load_policy
    from lldslight.rollout import VLLMGenerate
    base_dir = Path(tempfile.mkdtemp(prefix="lldslight-gpu-bench-"))
    base, tok = load_policy(PolicyConfig(**policy_kw, lora=None))  # the base alone: the adapter goes on when training loads it
    base.save_pretrained(base_dir, safe_serialization=True)
    tok.save_pretrained(base_dir)
    del base
    policy_kw = dict(model=str(base_dir), dtype=policy_kw["dtype"])
    backend_kw = dict(backend=functools.partial(VLLMGenerate, mode=os.environ.get("VLLM_MODE", "server"), python=os.environ.get("VLLM_PYTHON"),
                                                gpu_memory_utilization=float(os.environ.get("VLLM_GPU_MEMORY", "0.3"))))
module = GRPOModule(
    policy=PolicyConfig(**policy_kw, lora=LoRAConfig(r=16, alpha=32), gradient_checkpointing=True, attn_implementation="sdpa"),
    # GRPOModule takes its settings in groups (policy, update, optim), as the YAML's model.* keys
    update=UpdateConfig(updates_per_rollout=1, micro_batch_size=16, micro_batch_tokens=32768, kl_coef=0.001),
    optim=OptimConfig(lr=1e-5), logprob_chunk_size=1024,
)
rollout = RolloutConfig(group_size=G, max_turns=TURNS, max_new_tokens=NEW, max_obs_tokens=OBS, max_response_tokens=4 * (NEW + OBS), topk=2)
trainer = pl.Trainer(
    accelerator="gpu" if cuda else "cpu", devices=1, max_steps=1 + STEPS, logger=False, enable_checkpointing=False,
    enable_progress_bar=False, enable_model_summary=False,
    callbacks=[timer := Timer(), SearchRollout(retriever=Passages(), reward=lambda text, gold: float(len(text) % 2), rollout=rollout, **backend_kw),
               AfterStep()],
)
t_start = time.perf_counter()
trainer.fit(module, datamodule=Data())
total_s = time.perf_counter() - t_start

# Model FLOPs (no recompute): 2 N per token forward; backward through frozen LoRA bases 2 N (input
# gradients only; the adapters' weight gradients are negligible); attention 4 * layers * d * ctx.
base = module.policy.get_base_model()
n_matmul = sum(m.weight.numel() for name, m in base.named_modules() if isinstance(m, torch.nn.Linear) and "lora_" not in name)
cfg = base.config
steps = records[1:]  # the first step warms up (kernels, allocator)
med = lambda k: sorted(s[k] for s in steps)[len(steps) // 2]  # noqa: E731
r = steps[len(steps) // 2]
ctx = r["max_len"] / 2
attn_per_token = 4 * cfg.num_hidden_layers * cfg.hidden_size * ctx
rollout_flops = (2 * n_matmul + attn_per_token) * (r["model_tokens"] + r["obs_tokens"] + r["prompt_tokens"] / G)
ref_flops = (2 * n_matmul + attn_per_token) * r["all_tokens"]
update_flops = (4 * n_matmul + 3 * attn_per_token) * r["all_tokens"]
step_flops = rollout_flops + ref_flops + update_flops
peak = PEAK_TFLOPS * 1e12
rows = [
    ("device", torch.cuda.get_device_name() if cuda else "cpu (SMOKE)"),
    ("rollout backend", "vLLM (VLLMGenerate, " + os.environ.get("VLLM_MODE", "server") + ")" if vllm else "lldslight's engine"),
    ("model", f"random Qwen2.5-1.5B shape, {n_matmul / 1e9:.2f}B matmul params, bf16, LoRA r=16" if not smoke else "tiny (SMOKE)"),
    ("work / step", f"{N_PROMPTS} prompts x G={G} = {r['rows']} rollouts, {TURNS} turns + answer, {NEW} tokens/turn"),
    ("model tokens / step", f"{r['model_tokens']:.0f} (+{r['obs_tokens']:.0f} observation, {r['prompt_tokens']:.0f} prompt)"),
    ("rollout tokens/s", f"{r['model_tokens'] / med('rollout_s'):,.0f}"),
    ("step time (s)", f"{med('step_s'):.2f}"),
    ("  rollout (s)", f"{med('rollout_s'):.2f}  MFU {rollout_flops / med('rollout_s') / peak:.1%}"),
    ("  log-probs: ref (s)", f"{med('logprob_s'):.2f}  MFU {ref_flops / max(med('logprob_s'), 1e-9) / peak:.1%}"),
    ("  update (s)", f"{med('update_s'):.2f}  MFU {update_flops / med('update_s') / peak:.1%}"),
    ("weight push + probe (s)", f"{med('sync_s'):.2f}  after the step, not in its time"),
    ("step MFU", f"{step_flops / med('step_s') / peak:.1%} of {PEAK_TFLOPS:.0f} TFLOP/s"),
    ("peak GPU memory (GiB)", f"{max(s['peak_gb'] for s in steps):.1f}"),
    ("whole run (s)", f"{total_s:.0f} ({len(records)} steps, first = warm-up)"),
]
print()
print("| lldslight GRPO step, one GPU | |")
print("|---|---|")
for k, v in rows:
    print(f"| {k} | {v} |")
EOF
