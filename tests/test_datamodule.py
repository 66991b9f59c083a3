"""SearchQADataModule: batches, group ids, sharding without loss or duplicates, exact resume."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch

from lldslight.data import (
    QAExample,
    SearchQADataModule,
    ShardedEvalSampler,
    SynthConfig,
    TrainSampler,
    make_prompt,
    write_flashrag_jsonl,
    write_searchr1_parquet,
)
from lldslight.data.datamodule import EVAL_PADDING
from lldslight.data.formats import template_messages


def _write(tmp_path: Path, name: str, n: int, fmt: str = "jsonl") -> str:
    exs = []
    for i in range(n):
        q = f"{name} question {i}"
        msgs = [{"role": "system", "content": "file prompt"}, {"role": "user", "content": f"Question: {q}"}]
        exs.append(QAExample(id=f"{name}{i}", question=q, golden_answers=[f"a{i}"], data_source=name,
                             messages=msgs if fmt == "parquet" else template_messages(q)))
    path = tmp_path / f"{name}.{fmt}"
    (write_searchr1_parquet if fmt == "parquet" else write_flashrag_jsonl)(exs, path)
    return str(path)


@pytest.fixture()
def files(tmp_path: Path) -> dict[str, list[str]]:
    return {
        "train_files": [_write(tmp_path, "tra", 13), _write(tmp_path, "trb", 9, "parquet")],
        "val_files": [_write(tmp_path, "val", 11)],
        "test_files": [_write(tmp_path, "tst", 7, "parquet")],
    }


def _ids(batch: list[QAExample]) -> list[str]:
    return [e.id for e in batch]


def test_batches_group_ids_and_prompts(files: dict[str, list[str]]) -> None:
    dm = SearchQADataModule(**files, batch_size=4, eval_batch_size=4)
    dm.setup("fit")
    batches = list(dm.train_dataloader())
    assert len(batches) == 22 // 4 and all(len(b) == 4 for b in batches)  # incomplete batch dropped
    assert all(isinstance(e, QAExample) for b in batches for e in b)
    everything = dm.train_examples + dm.val_examples + dm.test_examples
    assert sorted(e.group_id for e in everything) == list(range(40))
    assert all(e.messages == [{"role": "user", "content": make_prompt(e.question)}] for e in everything)
    assert {e.data_source for e in dm.train_examples} == {"tra", "trb"}

    dm_file = SearchQADataModule(**files, prompt_source="file", data_sources={files["val_files"][0]: "renamed"})
    dm_file.setup()
    trb = [e for e in dm_file.train_examples if e.data_source == "trb"]
    assert trb[0].messages[0] == {"role": "system", "content": "file prompt"}
    tra = [e for e in dm_file.train_examples if e.data_source == "tra"]
    assert tra[0].messages[0]["content"] == make_prompt(tra[0].question)  # no file prompt: template
    assert {e.data_source for e in dm_file.val_examples} == {"renamed"}


def test_training_order_depends_on_seed_and_epoch(files: dict[str, list[str]]) -> None:
    def order(seed: int, epoch: int) -> list[str]:
        dm = SearchQADataModule(**files, batch_size=2, seed=seed)
        loader = dm.train_dataloader()
        loader.sampler.set_epoch(epoch)
        return [i for b in loader for i in _ids(b)]

    assert order(0, 0) == order(0, 0)
    assert order(0, 0) != order(0, 1) and order(0, 0) != order(1, 0)
    assert len(set(order(0, 0))) == 22


def test_limits_are_deterministic(files: dict[str, list[str]]) -> None:
    dm = SearchQADataModule(**files, limit_train=5, limit_val=3, limit_test=0)
    dm.setup()
    assert _ids(dm.train_examples) == [f"tra{i}" for i in range(5)]
    assert len(dm.val_examples) == 3 and dm.test_dataloader() == []


def test_val_keeps_every_example_and_rank_sharding(files: dict[str, list[str]]) -> None:
    dm = SearchQADataModule(**files, batch_size=3, eval_batch_size=4)
    assert sorted(i for b in dm.val_dataloader() for i in _ids(b)) == sorted(f"val{i}" for i in range(11))

    val, train = [], []
    for rank in range(2):
        dm.trainer = SimpleNamespace(world_size=2, global_rank=rank)  # what the samplers read
        val.append([i for b in dm.val_dataloader() for i in _ids(b)])
        train.append([i for b in dm.train_dataloader() for i in _ids(b)])
    # 11 examples over 2 ranks: rank 1 gets a filler so both run 2 batches (FSDP2 gathers weights
    # collectively per rollout batch); the filler's records are dropped when results are gathered.
    assert len(val[0]) == len(val[1]) == 6 and val[1][-1] == EVAL_PADDING
    assert sorted(i for i in val[0] + val[1] if i != EVAL_PADDING) == sorted(f"val{i}" for i in range(11))
    assert not set(train[0]) & set(train[1]) and len(train[0]) == len(train[1]) == 3 * (22 // 6)

    s = [list(ShardedEvalSampler(5, 2, r)) for r in range(2)]
    assert s == [[0, 2, 4], [1, 3, -1]] and isinstance(ShardedEvalSampler(5, 2, 0), torch.utils.data.DistributedSampler)
    assert [list(ShardedEvalSampler(5, 2, r, pad=False)) for r in range(2)] == [[0, 2, 4], [1, 3]]
    assert [len(ShardedEvalSampler(5, 2, r, pad=False)) for r in range(2)] == [3, 2]


def test_eval_filler_records_are_dropped() -> None:
    from lldslight.rollout.evaluation import gather_records

    records = [{"data_source": "nq", "em": 1.0}, {"data_source": EVAL_PADDING, "em": 1.0}]
    assert gather_records(records) == records[:1]


def test_resume_state_skips_consumed_batches(files: dict[str, list[str]]) -> None:
    dm = SearchQADataModule(**files, batch_size=4)
    it = iter(dm.train_dataloader())
    first = [_ids(next(it)) for _ in range(2)]
    state = dm.state_dict()
    assert state["prompts_consumed"] == 8 and state["epoch"] == 0
    expected = _ids(next(it))

    dm2 = SearchQADataModule(**files, batch_size=4)
    dm2.load_state_dict(state)
    rest = [_ids(b) for b in dm2.train_dataloader()]
    assert rest[0] == expected and not {i for b in rest for i in b} & {i for b in first for i in b}
    assert len(rest) == 22 // 4 - 2


def test_missing_file_names_the_argument(tmp_path: Path, files: dict[str, list[str]]) -> None:
    dm = SearchQADataModule(**{**files, "val_files": files["val_files"] + [str(tmp_path / "gone.jsonl")]})
    with pytest.raises(FileNotFoundError, match=r"val_files\[1\]: .*gone\.jsonl"):
        dm.setup()


def test_synthesize_defaults_files(tmp_path: Path) -> None:
    dm = SearchQADataModule(synthesize=SynthConfig(out_dir=str(tmp_path / "kb"), entities=40, dev=6, test=6))
    dm.prepare_data()
    dm.setup()
    assert len(dm.val_examples) == 6 and len(dm.test_examples) == 6 and dm.train_examples
    assert {e.data_source for e in dm.train_examples} == {"synth_1hop", "synth_2hop", "synth_comparison"}


# ----------------------------------------------------------------------------- with a Trainer


class _Recorder(pl.LightningModule):
    """Trains one scalar and records the prompts of every training batch."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[list[str]] = []

    def training_step(self, batch: list[QAExample], batch_idx: int) -> torch.Tensor:
        self.seen.append(_ids(batch))
        return ((self.w - 1) ** 2).sum()

    def validation_step(self, batch: list[QAExample], batch_idx: int) -> None:
        pass

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _trainer(tmp_path: Path, **kw) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=tmp_path, num_sanity_val_steps=0, **kw)


@pytest.mark.parametrize("stop_step", [3, 5])  # mid-epoch, and exactly at the end of epoch 0
def test_trainer_resume_continues_with_the_same_batches(tmp_path: Path, files: dict[str, list[str]], stop_step: int) -> None:
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=stop_step, save_top_k=-1)
    full = _Recorder()
    _trainer(tmp_path, callbacks=[ckpt]).fit(full, datamodule=SearchQADataModule(**files, batch_size=4))
    assert len(full.seen) == 2 * (22 // 4) and full.seen[:5] != full.seen[5:]

    path = next(p for p in (tmp_path / "ckpt").iterdir() if f"step={stop_step}" in p.name)
    resumed = _Recorder()
    same_ckpt = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt2", every_n_train_steps=stop_step, save_top_k=-1)
    _trainer(tmp_path, callbacks=[same_ckpt]).fit(resumed, datamodule=SearchQADataModule(**files, batch_size=4), ckpt_path=path)
    assert resumed.seen == full.seen[stop_step:]


def test_lightning_keeps_our_samplers_under_ddp(files: dict[str, list[str]]) -> None:
    """With the default use_distributed_sampler=True, Lightning must not swap in its (padding) sampler."""
    from lightning.pytorch.trainer.states import RunningStage

    trainer = pl.Trainer(accelerator="cpu", strategy="ddp", devices=2, logger=False)  # not launched
    dm = SearchQADataModule(**files, batch_size=2)
    dm.trainer = trainer
    assert trainer.world_size == 2
    for loader, stage in ((dm.train_dataloader(), RunningStage.TRAINING), (dm.val_dataloader(), RunningStage.VALIDATING)):
        prepared = trainer._data_connector._prepare_dataloader(loader, shuffle=stage == RunningStage.TRAINING, mode=stage)
        assert prepared.sampler is loader.sampler
