"""VLLMGenerate in mode 'inprocess' (vllm.LLM in this process), run by vLLM's own environment for
tests/test_vllm.py (vLLM pins another transformers than the main environment's).

Arguments: the model folder, the corpus, the train jsonl, the JSON file to write, and how the
weights are pushed (``lora``, the default, or ``merged``). It checks, and writes for the test to
assert (lora):

- greedy episodes, before and after an adapter push, equal the engine's token for token (the same
  fields tests/test_backends.py compares);
- the probe through vLLM after a push against the trainer's forward;
- an adapter re-added under the same id WITHOUT load_inplace (vLLM then keeps serving the old one,
  silently): the weight-sync check's message, which must name the step;

and (merged) greedy episodes and the probe after the adapter's merged weights are copied into
vLLM's model, then after a full fine-tuning policy's changed weights are.
"""
from __future__ import annotations

import json
import sys

import torch


def main(model_dir: str, corpus: str, train_jsonl: str, out: str, weights: str = "lora") -> None:
    from lldslight.data.formats import load_examples
    from lldslight.policy import LoRAConfig, PolicyConfig, load_policy
    from lldslight.retrieval import BM25Retriever
    from lldslight.rollout import RolloutConfig, RolloutEngine, VLLMGenerate, WeightSync
    from lldslight.rollout.sync import SyncMismatch, probe_ids, token_logprobs
    from lldslight.rollout.vllm_generate import ADAPTER_ID, ADAPTER_NAME

    examples = [e for e in load_examples(train_jsonl) if e.meta.get("type") == "1hop"][:3]
    for gid, e in enumerate(examples):  # as tests/conftest.py's protocol_examples
        e.group_id = gid
        e.messages = [{"role": "user", "content": f"Search, then answer. Question: {e.question}"}]
    bm25 = BM25Retriever(corpus=corpus, show_progress=False)
    model, tok = load_policy(PolicyConfig(model=model_dir, precision="fp32", lora=LoRAConfig(r=4, alpha=8), gradient_checkpointing=False))
    config = RolloutConfig(group_size=1, greedy=True, topk=1, max_turns=2, max_new_tokens=24, max_obs_tokens=200, max_response_tokens=400)
    backend = VLLMGenerate(tok, bm25, lambda text, gold: 0.0, config, mode="inprocess", weights=weights)
    fields = ("input_ids", "loss_mask", "action_id", "answer_mask", "num_searches", "num_actions")
    result = {"same_as_engine": []}

    def compare() -> None:
        served = backend.generate(model, examples)
        result["syncs"] = backend.syncs
        engine = RolloutEngine(tok, bm25, lambda text, gold: 0.0, config).generate(model, examples)
        same = all(torch.equal(getattr(served, f), getattr(engine, f)) for f in fields)
        same = same and served.responses == engine.responses and served.finish_reason == engine.finish_reason
        same = same and bool(torch.allclose(served.sample_logp, engine.sample_logp, atol=1e-4))
        result["same_as_engine"].append(same)
        result["searched"] = int(engine.num_searches.sum()) >= 1
        result["answered"] = "answer" in engine.finish_reason

    def move(seed: int, scale: float) -> None:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.add_(torch.randn(p.shape, generator=gen) * scale)

    def probe_gap() -> float:
        ids = probe_ids(tok)
        backend.probe_logprob(model, ids)
        served = torch.tensor(backend.client.prompt_logprobs(ids, backend.conn.adapter), dtype=torch.float64)
        return float((served - token_logprobs(model, ids)).abs().max())

    def probe_moves(change) -> tuple[float, float]:
        """How far the probe's summed log-prob moved through vLLM and through the trainer, over ``change``."""
        ids = probe_ids(tok)
        before = (backend.probe_logprob(model, ids), float(token_logprobs(model, ids).sum()))
        change()
        after = (backend.probe_logprob(model, ids), float(token_logprobs(model, ids).sum()))
        return after[0] - before[0], after[1] - before[1]

    compare()
    result["probe_moves"] = probe_moves(lambda: move(1, 0.05))
    compare()
    result["probe_gap"] = probe_gap()
    if weights == "merged":
        # full fine-tuning: no adapter, every weight trainable; one layer's weights moved
        model, tok = load_policy(PolicyConfig(model=model_dir, precision="fp32", lora=None, gradient_checkpointing=False))
        backend = VLLMGenerate(tok, bm25, lambda text, gold: 0.0, config, mode="inprocess", weights=weights)  # the same vllm.LLM
        gen = torch.Generator().manual_seed(3)

        def full_move():
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if ".layers.1." in name and p.dim() == 2:
                        p.add_(torch.randn(p.shape, generator=gen) * 0.01)

        result["full_probe_moves"] = probe_moves(full_move)
        compare()
        result["full_probe_gap"] = probe_gap()
        with open(out, "w") as f:
            json.dump(result, f)
        return

    class ReloadWithoutInplace(VLLMGenerate):
        """Pushes each adapter as a naive sync would: add_lora under the same id, without load_inplace."""

        def _sync(self, model):
            from vllm.lora.request import LoRARequest

            folder = self.conn.workdir / f"naive-{self.conn.syncs}"
            model.save_pretrained(str(folder), safe_serialization=True)
            self.conn.client.llm.llm_engine.add_lora(LoRARequest(ADAPTER_NAME, ADAPTER_ID, str(folder)))
            self.conn.adapter = str(folder)
            self.conn.syncs += 1

    naive = ReloadWithoutInplace(tok, bm25, lambda text, gold: 0.0, config, mode="inprocess")
    naive.conn = backend.conn  # the same vllm.LLM
    sync = WeightSync(1e-4)
    sync.start(naive.probe_logprob, model, tok)
    move(2, 0.3)
    try:
        sync.after_step(naive.probe_logprob, model, 0)
        result["reload_without_inplace"] = "not caught"
    except SyncMismatch as err:
        result["reload_without_inplace"] = str(err)
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:6])
