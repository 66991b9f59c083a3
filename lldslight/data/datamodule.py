"""SearchQADataModule: question files in, batches of QAExample out (docs/architecture.md, One training step).

Sharding is done here, not by Lightning: both samplers subclass ``DistributedSampler``, so
Lightning never swaps in its own whatever ``Trainer(use_distributed_sampler=...)`` says. That is
the robust option: nothing to remember in the trainer config, and evaluation under DDP sees every
example exactly once (Lightning's DistributedSampler pads with duplicates to equalise ranks).

Exact resume: the datamodule counts training batches as the training loop consumes them (the
``on_before_batch_transfer`` hook runs once per batch, right before ``training_step``; counting
in the sampler would be off by Lightning's prefetch) and saves {epoch, prompts consumed} in
its ``state_dict``, which Lightning stores in every checkpoint. After ``load_state_dict`` the
train sampler skips the consumed prompts of that epoch's permutation, so the next batch is the one
the interrupted run would have trained on next. The train loader also declares itself resumable
(``ResumableDataLoader``) so Lightning does not warn that a mid-epoch resume is unreliable.

Refill stream (dynamic sampling, ``SearchRollout(dynamic_sampling=...)``): further training prompts
drawn on demand by ``refill_prompts``, from their own shuffled order (seed, epoch and a stream tag,
so it never shifts the main order) and with their own position, saved in ``state_dict`` beside
the main one: a resumed run draws the same refill prompts it would have drawn.
"""
from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Iterator, Literal, Optional

import lightning.pytorch as pl
import numpy as np
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lldslight.data.example import QAExample, check_template, make_prompt
from lldslight.data.formats import load_examples
from lldslight.data.synth import synthesize as synthesize_kb
from lldslight.errors import ConfigError, MissingFileError, require, require_choice


@dataclass
class SynthConfig:
    """Generate the synthetic knowledge base (lldslight.data.synth) in ``prepare_data``.

    Args:
        out_dir: Where the knowledge base lives; regenerated only when missing or different.
        seed: Generator seed; the same seed gives byte-identical files.
        entities: Number of entities with a passage (countries, cities, organisations, people, works).
        dev: Number of dev questions (balanced over 1-hop / 2-hop / comparison).
        test: Number of test questions (balanced the same way).
    """

    out_dir: str = "data/synthkb"
    seed: int = 0
    entities: int = 200
    dev: int = 64
    test: int = 64


def collate_examples(batch: list[QAExample]) -> list[QAExample]:
    """Batches stay lists of QAExample: rollout needs questions and answers, not tensors."""
    return list(batch)


@dataclass
class TrainPosition:
    """Where training is in the data: the epoch, the prompts skipped at its start (restored from
    a checkpoint) and the batches consumed since."""

    epoch: int = 0
    start: int = 0
    batches: int = 0


@dataclass
class RefillPosition:
    """Where the refill stream is: its epoch and the prompts (all ranks together) drawn from it."""

    epoch: int = 0
    drawn: int = 0


_REFILL_STREAM = 1  # mixed into the refill order's seed: a different order from the main one


class TrainSampler(DistributedSampler):
    """Shuffled per epoch from (seed, epoch); each global batch of ``batch_size * world_size``
    prompts is split so rank r gets its r-th slice (distinct prompts on every rank). Incomplete
    global batches are dropped. The first ``position.start`` prompts of the epoch's order are
    skipped (resume).

    ``len()`` is always the full epoch (``num_batches * batch_size`` indices): Lightning's loop keeps
    counting a resumed epoch from the restored batch index, so a shorter length would end it early.
    """

    def __init__(
        self,
        num_examples: int,
        batch_size: int,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        position: Optional[TrainPosition] = None,
        count_batches: bool = False,
    ):
        super().__init__(range(num_examples), num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        self.n = num_examples
        self.batch_size = batch_size
        self.position = position if position is not None else TrainPosition()
        self.epoch = self.position.epoch
        # Without a trainer nothing prefetches, so a batch is consumed when its indices are drawn.
        self.count_batches = count_batches
        self.num_batches = num_examples // (batch_size * num_replicas)

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.position.epoch:
            self.position.epoch, self.position.start, self.position.batches = epoch, 0, 0
        self.epoch = epoch

    def order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.n)
        return np.random.default_rng([self.seed, epoch]).permutation(self.n)

    def __iter__(self) -> Iterator[int]:
        order = self.order(self.position.epoch)[self.position.start :]
        step = self.batch_size * self.num_replicas
        lo = self.rank * self.batch_size
        for b in range(len(order) // step):
            chunk = order[b * step + lo : b * step + lo + self.batch_size]
            for j, i in enumerate(chunk):
                if self.count_batches and j == len(chunk) - 1:
                    self.position.batches += 1  # before the last yield: the generator may never resume
                yield int(i)

    def __len__(self) -> int:
        return self.num_batches * self.batch_size


EVAL_PADDING = "__eval_padding__"  # data_source of the filler rows; lldslight.rollout.evaluation drops their records


class ShardedEvalSampler(DistributedSampler):
    """Rank r takes examples r, r+W, r+2W, ...: every example exactly once over all ranks.

    With ``pad`` (the default), ranks that hold one example fewer get the index -1 as filler, so
    every rank runs the same number of evaluation batches: under FSDP2 each rollout batch gathers
    the sharded weights collectively, and a rank with one batch fewer would leave the others
    waiting forever. ``EvalSet`` turns -1 into a filler example whose records are dropped.
    """

    def __init__(self, num_examples: int, num_replicas: int = 1, rank: int = 0, pad: bool = True):
        super().__init__(range(num_examples), num_replicas=num_replicas, rank=rank, shuffle=False)
        self.n = num_examples
        self.pad = pad

    def __iter__(self) -> Iterator[int]:
        mine = list(range(self.rank, self.n, self.num_replicas))
        if self.pad:
            mine += [-1] * (-(-self.n // self.num_replicas) - len(mine))
        return iter(mine)

    def __len__(self) -> int:
        return -(-self.n // self.num_replicas) if self.pad else len(range(self.rank, self.n, self.num_replicas))


class EvalSet(Dataset):
    """Evaluation examples; index -1 is a filler (a copy of the first example, marked EVAL_PADDING)."""

    def __init__(self, examples: list[QAExample]):
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> QAExample:
        if i >= 0:
            return self.examples[i]
        return replace(self.examples[0], id=EVAL_PADDING, data_source=EVAL_PADDING, group_id=-1)


class ResumableDataLoader(DataLoader):
    """The training loader. Its position is the datamodule's (saved under the datamodule's key of
    the checkpoint); these methods only tell Lightning the loader resumes mid-epoch, so it does not
    warn that it cannot."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


PromptSource = Literal["template", "file"]
_SPLIT_ARGS = (("train", "train_files"), ("val", "val_files"), ("test", "test_files"))
_SYNTH_FILES = {"train": "train.parquet", "val": "dev.parquet", "test": "test.parquet"}


class SearchQADataModule(pl.LightningDataModule):
    """Question-answering data for search-agent RL: Search-R1 parquet, FlashRAG jsonl, the multi-hop
    sets, HF datasets saved to disk, or the synthetic knowledge base.

    Args:
        train_files: Question files for training (any format ``load_examples`` reads).
        val_files: Question files for validation.
        test_files: Question files for testing.
        batch_size: Prompts per training step on each rank (each is expanded to G rollouts later).
        eval_batch_size: Prompts per validation / test batch.
        prompt_source: "template" rebuilds the user prompt from the question (Search-R1 template);
            "file" uses the file's own prompt when it has one, else the template.
        prompt_template: the template "template" uses, with one ``{question}``; None = Search-R1's.
            The collapse lab's from-scratch policy uses "Question: {question}\\n": its
            instruction preamble (~130 of its ~300 tokens) tells a model trained from random
            weights nothing, and every update pays for it.
        shuffle: Shuffle training prompts (per epoch, from ``seed`` and the epoch number).
        seed: Seed of the training order.
        limit_train: Keep only the first N training examples (after loading, deterministic).
        limit_val: Keep only the first N validation examples.
        limit_test: Keep only the first N test examples.
        data_sources: Maps a file path, as written in the *_files lists, to the data_source its
            examples get (overrides the file's own); per-data_source metrics use this name.
        synthesize: Generate the synthetic knowledge base in ``prepare_data``; empty *_files then
            default to its train / dev / test parquet files.
    """

    def __init__(
        self,
        train_files: Optional[list[str]] = None,
        val_files: Optional[list[str]] = None,
        test_files: Optional[list[str]] = None,
        batch_size: int = 4,
        eval_batch_size: int = 16,
        prompt_source: PromptSource = "template",
        prompt_template: Optional[str] = None,
        shuffle: bool = True,
        seed: int = 0,
        limit_train: Optional[int] = None,
        limit_val: Optional[int] = None,
        limit_test: Optional[int] = None,
        data_sources: Optional[dict[str, str]] = None,
        synthesize: Optional[SynthConfig] = None,
    ):
        super().__init__()
        require(batch_size >= 1, "data.batch_size", ">= 1", batch_size)
        require(eval_batch_size >= 1, "data.eval_batch_size", ">= 1", eval_batch_size)
        require_choice(prompt_source, "data.prompt_source", PromptSource)
        self.files = {"train": list(train_files or []), "val": list(val_files or []), "test": list(test_files or [])}
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size
        self.prompt_source = prompt_source
        if prompt_template is not None:
            check_template(prompt_template, "data.prompt_template")
        self.prompt_template = prompt_template
        self.shuffle = shuffle
        self.seed = seed
        self.limits = {"train": limit_train, "val": limit_val, "test": limit_test}
        self.data_sources = dict(data_sources or {})
        self.synthesize = SynthConfig(**synthesize) if isinstance(synthesize, dict) else synthesize
        self.train_examples: list[QAExample] = []
        self.val_examples: list[QAExample] = []
        self.test_examples: list[QAExample] = []
        self._loaded = False
        self._position = TrainPosition()
        self._restored: Optional[dict[str, Any]] = None
        self._train_world_size = 1
        self._refill = RefillPosition()

    # ------------------------------------------------------------------ data

    def prepare_data(self) -> None:
        if self.synthesize is not None:
            synthesize_kb(**asdict(self.synthesize))

    def resolved_files(self) -> dict[str, list[str]]:
        """The files of each split, with the synthetic knowledge base filling empty lists."""
        files = {k: list(v) for k, v in self.files.items()}
        if self.synthesize is not None:
            for split, name in _SYNTH_FILES.items():
                if not files[split]:
                    files[split] = [str(Path(self.synthesize.out_dir) / name)]
        return files

    def setup(self, stage: Optional[str] = None) -> None:
        """Load every split once (group ids must be unique across all of them)."""
        if self._loaded:
            return
        files = self.resolved_files()
        missing = [(arg, i, f) for split, arg in _SPLIT_ARGS for i, f in enumerate(files[split]) if not Path(f).exists()]
        if missing and self.synthesize is not None and self._world()[0] == 1:
            self.prepare_data()  # used without a Trainer, which would have called it first
            missing = [m for m in missing if not Path(m[2]).exists()]
        if missing:
            lines = "\n".join(f"  {arg}[{i}]: {f}" for arg, i, f in missing)
            raise MissingFileError(f"SearchQADataModule: data file(s) not found:\n{lines}")

        next_group = 0
        for split, _ in _SPLIT_ARGS:
            examples: list[QAExample] = []
            for f in files[split]:
                for ex in load_examples(f, data_source=self.data_sources.get(f)):
                    if self.prompt_source == "file" and ex.meta.get("file_messages"):
                        ex.messages = [dict(m) for m in ex.meta["file_messages"]]
                    elif self.prompt_template is not None:
                        ex.messages = [{"role": "user", "content": make_prompt(ex.question, self.prompt_template)}]
                    ex.split = ex.split or split
                    # Sequential over train, val, test files in order: unique, and the same for a
                    # given config whatever the limits, so a group id names one prompt for good.
                    ex.group_id = next_group
                    next_group += 1
                    examples.append(ex)
            limit = self.limits[split]
            setattr(self, f"{split}_examples", examples if limit is None else examples[: max(0, limit)])
        self._loaded = True
        if stage == "fit" and self.trainer is not None:
            # Here, before the policy loads (Lightning sets data up first), not at the first batch.
            self._check_train_size(self._world()[0])

    def _check_train_size(self, world_size: int) -> None:
        n = len(self.train_examples)
        if n < self.batch_size * world_size:
            files = self.resolved_files()["train"]
            what = "no examples" if n == 0 else f"{n} example(s), fewer than data.batch_size ({self.batch_size}) x world_size ({world_size})"
            raise ConfigError(f"the training set ({', '.join(files) or 'data.train_files'}) has {what}: no complete "
                              "training batch" + (f" (data.limit_train={self.limits['train']})" if self.limits["train"] is not None else ""))

    # ------------------------------------------------------------------ loaders

    def _world(self) -> tuple[int, int]:
        trainer = self.trainer
        if trainer is None:
            return 1, 0
        return int(trainer.world_size), int(trainer.global_rank)

    def train_dataloader(self) -> DataLoader:
        self.setup("fit")
        world_size, rank = self._world()
        n = len(self.train_examples)
        self._check_train_size(world_size)
        self._apply_restored(n, world_size)
        self._train_world_size = world_size
        sampler = TrainSampler(
            n, self.batch_size, world_size, rank, self.shuffle, self.seed, self._position,
            count_batches=self.trainer is None,
        )
        return ResumableDataLoader(
            self.train_examples, batch_size=self.batch_size, sampler=sampler, drop_last=True,
            collate_fn=collate_examples,
        )

    def refill_prompts(self, n: int) -> list[QAExample]:
        """The next ``n`` training prompts of this rank's refill stream (dynamic sampling).

        Every call takes the next ``n x world_size`` prompts of a per-epoch shuffled order (seeded
        by (seed, epoch, 1), so it differs from the main order) and hands rank r its r-th slice of
        ``n``: ranks get distinct prompts, and since every rank calls this the same number of times
        with the same ``n``, one position describes all of them. When fewer than ``n x world_size``
        prompts are left in the epoch's order, the stream moves on to its next epoch. Deterministic,
        and resumed exactly from a checkpoint (``state_dict``).
        """
        self.setup("fit")
        world_size, rank = self._world()
        total, count = len(self.train_examples), n * world_size
        require(n >= 1 and count <= total, f"refill_prompts({n}): n x world_size", f"in [1, {total}] (the training "
                "examples)", count, "dynamic sampling refills from the training set")
        pos = self._refill
        if pos.drawn + count > total:
            pos.epoch, pos.drawn = pos.epoch + 1, 0
        if self.shuffle:
            order = np.random.default_rng([self.seed, pos.epoch, _REFILL_STREAM]).permutation(total)
        else:
            order = np.arange(total)
        start = pos.drawn + rank * n
        pos.drawn += count
        return [self.train_examples[int(i)] for i in order[start : start + n]]

    def _eval_loader(self, examples: list[QAExample]) -> DataLoader | list:
        if not examples:
            return []  # Lightning skips the loop
        world_size, rank = self._world()
        return DataLoader(
            EvalSet(examples), batch_size=self.eval_batch_size, sampler=ShardedEvalSampler(len(examples), world_size, rank),
            drop_last=False, collate_fn=collate_examples,
        )

    def val_dataloader(self) -> DataLoader | list:
        self.setup("validate")
        return self._eval_loader(self.val_examples)

    def test_dataloader(self) -> DataLoader | list:
        self.setup("test")
        return self._eval_loader(self.test_examples)

    # ------------------------------------------------------------------ resume

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        trainer = self.trainer
        if trainer is not None and trainer.training:
            self._position.batches += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        p = self._position
        return {
            "epoch": p.epoch,
            "prompts_consumed": p.start + p.batches * self.batch_size * self._train_world_size,
            "num_train": len(self.train_examples) if self._loaded else -1,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "refill_epoch": self._refill.epoch,
            "refill_drawn": self._refill.drawn,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = dict(state_dict)
        self._position = TrainPosition(epoch=int(state_dict["epoch"]), start=int(state_dict["prompts_consumed"]))
        # Checkpoints written before the refill stream existed have no refill keys: start it afresh.
        self._refill = RefillPosition(int(state_dict.get("refill_epoch", 0)), int(state_dict.get("refill_drawn", 0)))

    def _apply_restored(self, n: int, world_size: int) -> None:
        """Check a restored position against the data it will index into (once, at loader creation)."""
        sd, self._restored = self._restored, None
        if sd is None:
            return
        same = (sd.get("num_train"), sd.get("seed"), sd.get("shuffle")) == (n, self.seed, self.shuffle)
        if not same:
            warnings.warn(
                f"SearchQADataModule: resuming with different training data or order (checkpoint: num_train="
                f"{sd.get('num_train')}, seed={sd.get('seed')}, shuffle={sd.get('shuffle')}; now {n}, {self.seed},"
                f" {self.shuffle}); the mid-epoch position is approximate.",
                stacklevel=2,
            )
        if self._position.start >= n:
            self._position.start = n  # epoch finished: the loop moves on to the next one
