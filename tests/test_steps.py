"""The core's apply-and-save sequence (gyre.learning.steps) on a real trainer (a tiny Qwen3 on CPU)."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest

from gyre.learning import checkpoint
from gyre.learning.steps import apply_step, weights_path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = tmp_path_factory.mktemp("tiny-qwen3-steps")
    cfg = Qwen3Config(vocab_size=256, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, intermediate_size=32, max_position_embeddings=64,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(out)
    return out


def test_weights_path():
    assert weights_path(Path("/runs/r1/weights"), 3) == Path("/runs/r1/weights/v3")


def test_apply_step_of_a_step_without_microsteps_still_makes_a_version(model_dir, tmp_path):
    from gyre.learning.trainer import Trainer, TrainerConfig

    trainer = Trainer(model_dir, TrainerConfig())
    done = apply_step(trainer, executions=0, weights_dir=tmp_path, extra={"k": 1})  # |E| = max(0, 1) = 1
    assert (done.policy_version, trainer.policy_version, done.path) == (1, 1, tmp_path / "v1")
    assert (done.stats.executions, done.stats.loss, done.stats.tokens) == (1, 0.0, 0)
    assert (done.path / "config.json").is_file() and (done.path / "model.safetensors").is_file()
    assert checkpoint.read_state(done.path)["extra"] == {"k": 1} and done.optimizer_s >= 0 and done.checkpoint_s > 0


def test_apply_step_divides_by_the_sealed_executions(model_dir, tmp_path):
    """One execution (A = +1) with two trained tokens, |E| = 2, on policy (every ratio 1):
    L = −(1/|E|)·(1/N_A)·Σ_{t∈K} A = −(1/2)·(1/2)·(1 + 1) = −0.5."""
    from gyre.learning.trainer import Trainer, TrainerConfig
    from gyre.trajectory.microstep import Sample, pack
    from gyre.trajectory.tree import Trajectory

    mask = np.array([False, False, True, True])
    traj = Trajectory(execution="A", leaf="A:0", role="main", input_ids=np.array([11, 12, 13, 14], dtype=np.int32),
                      loss_mask=mask, behaviour_logprobs=np.zeros(4, dtype=np.float32),
                      versions=np.where(mask, 0, -1).astype(np.int32), temperatures=np.ones(4, dtype=np.float32))
    (ms,) = pack([Sample("A", 1.0, (traj,))], 100)
    trainer = Trainer(model_dir, TrainerConfig(), policy_version=4)
    trainer.accumulate(dataclasses.replace(ms, behaviour_logprobs=trainer.logprobs(ms)))
    done = apply_step(trainer, executions=2, weights_dir=tmp_path)
    assert done.stats.loss == pytest.approx(-0.5, abs=1e-6)
    assert (done.stats.executions, done.stats.tokens, done.stats.microsteps) == (2, 2, 1)
    assert (done.policy_version, done.path) == (5, tmp_path / "v5")
    assert (done.path / "model.safetensors").is_file() and checkpoint.latest(tmp_path) == done.path


def test_the_core_epoch_rises_at_every_start(tmp_path):
    assert [checkpoint.next_epoch(tmp_path / "w") for _ in range(3)] == [0, 1, 2]
