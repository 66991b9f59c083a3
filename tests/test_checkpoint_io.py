"""Checkpoint plumbing without a training run: crash-safe writes, trainable-only state with a key
check that names the offending keys, RNG capture/restore, and `--ckpt_path last` resolution."""
from __future__ import annotations

import os
import random
import time

import numpy as np
import pytest
import torch
from jsonargparse import Namespace

from lldslight.run.checkpoint_io import (
    AtomicCheckpointIO,
    capture_rng,
    newest_last_checkpoint,
    resolve_last_checkpoint,
    restore_rng,
)
from lldslight.errors import CheckpointError
from tests.conftest import tiny_policy_config


def test_atomic_write_keeps_the_previous_checkpoint_when_a_write_dies(tmp_path, monkeypatch):
    io = AtomicCheckpointIO()
    path = tmp_path / "ckpts" / "last.ckpt"
    io.save_checkpoint({"step": 1, "w": torch.ones(1000)}, path)
    assert torch.load(path, weights_only=True)["step"] == 1

    real_save = torch.save

    def torn_save(obj, f, *args, **kwargs):  # half a file, then the disk fills up (or the process dies)
        f.write(b"PK\x03\x04 half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", torn_save)
    with pytest.raises(OSError, match="No space left"):
        io.save_checkpoint({"step": 2}, path)
    monkeypatch.setattr(torch, "save", real_save)
    assert torch.load(path, weights_only=True)["step"] == 1, "the previous checkpoint was damaged"
    assert sorted(os.listdir(path.parent)) == ["last.ckpt"], "a temporary file was left behind"
    io.save_checkpoint({"step": 2}, path)
    assert torch.load(path, weights_only=True)["step"] == 2


def test_rng_capture_and_restore_cover_torch_numpy_python():
    state = capture_rng()
    a = (torch.rand(3), np.random.rand(3), random.random())
    restore_rng(state)
    b = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]
    # Stored as tensors and plain Python values: loadable with torch.load(weights_only=True).
    buf = __import__("io").BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    restore_rng(torch.load(buf, weights_only=True))
    assert torch.equal(torch.rand(3), a[0])


def test_ckpt_path_last_finds_the_newest_run_of_a_numbered_logger(tmp_path):
    for version, delay in (("version_0", 0), ("version_1", 0.05)):
        d = tmp_path / "tiny" / version / "checkpoints"
        d.mkdir(parents=True)
        time.sleep(delay)
        (d / "last.ckpt").write_bytes(b"x")
    (tmp_path / "tiny" / "version_2").mkdir()  # a run that died before its first checkpoint
    assert newest_last_checkpoint(str(tmp_path), "tiny") == tmp_path / "tiny" / "version_1" / "checkpoints" / "last.ckpt"

    def cfg(**logger_args):
        logger = Namespace(class_path="lightning.pytorch.loggers.CSVLogger", init_args=Namespace(**logger_args))
        return Namespace(ckpt_path="last", trainer=Namespace(logger=logger, callbacks=[]))

    c = cfg(save_dir=str(tmp_path), name="tiny", version=None)
    resolve_last_checkpoint(c)
    assert c.ckpt_path.endswith("version_1/checkpoints/last.ckpt")
    c = cfg(save_dir=str(tmp_path), name="tiny", version=0)  # a fixed version: Lightning's own lookup
    resolve_last_checkpoint(c)
    assert c.ckpt_path == "last"
    # Nothing there: fit says so and starts fresh (no Lightning warning with its save_last hint);
    # validate/test stop, since evaluating untrained weights is not what was asked.
    c = cfg(save_dir=str(tmp_path / "none"), name="tiny", version=None)
    resolve_last_checkpoint(c, "fit")
    assert c.ckpt_path is None
    for sub in ("validate", "test"):
        c = cfg(save_dir=str(tmp_path / "none"), name="tiny", version=None)
        with pytest.raises(CheckpointError, match=r"--ckpt_path last: no checkpoint matches .*none/tiny/\*/checkpoints/last\.ckpt"):
            resolve_last_checkpoint(c, sub)


def test_checkpoint_holds_trainable_weights_and_a_mismatch_names_the_keys():
    from lldslight.module import GRPOModule

    module = GRPOModule(policy=tiny_policy_config())
    module.configure_model()
    checkpoint = {"state_dict": module.state_dict()}
    module.on_save_checkpoint(checkpoint)
    keys = set(checkpoint["state_dict"])
    assert keys and all(".lora_" in k for k in keys), sorted(keys)[:3]
    assert keys == {n for n, p in module.named_parameters() if p.requires_grad}

    fresh = GRPOModule(policy=tiny_policy_config())  # no configure_model: loading builds the model first
    ok = {"state_dict": dict(checkpoint["state_dict"]), "lldslight": checkpoint["lldslight"]}
    fresh.on_load_checkpoint(ok)
    assert fresh.policy is not None and len(ok["state_dict"]) > len(keys)  # completed with the frozen weights

    renamed = dict(checkpoint["state_dict"])
    key = sorted(renamed)[0]
    renamed[key.replace("lora_A", "lora_Z")] = renamed.pop(key)
    with pytest.raises(ValueError) as err:
        fresh.on_load_checkpoint({"state_dict": renamed})
    assert "lora_Z" in str(err.value) and key in str(err.value)

    wrong_rank = GRPOModule(policy=tiny_policy_config())
    wrong_rank.policy_config.lora.r = 8
    with pytest.raises(ValueError, match="shapes differ"):
        wrong_rank.on_load_checkpoint({"state_dict": dict(checkpoint["state_dict"])})
