"""Step accounting of a trainer replica (gyre.learning.steps) on hand-worked cases, and the
apply-and-save sequence on a real trainer (a tiny Qwen3 on CPU)."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest

from gyre.learning.steps import StepAccounts, applied, apply_step, weights_path
from schemas import StepSealed

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def seal(step: int, microsteps: int, executions: int = 2, reward_mean: float = 0.5) -> StepSealed:
    return StepSealed(event_id=f"r:step:{step}:sealed", step=step, microsteps=microsteps, executions=executions,
                      groups=1, reward_mean=reward_mean)


def test_a_step_is_ready_once_sealed_and_every_microstep_counted():
    acc = StepAccounts()
    sealed = seal(0, microsteps=2)
    acc.seal(sealed)
    assert acc.ready(0, policy_version=0) is None  # sealed, none counted
    acc.microstep_arrived(0, now=10.0)
    acc.microstep_counted(0)
    assert acc.ready(0, policy_version=0) is None  # 1 of 2
    acc.microstep_arrived(0, now=11.0)  # the clock started with the first one
    acc.microstep_counted(0)
    assert acc.ready(0, policy_version=0) is sealed
    assert acc.duration_s(0, now=12.5) == 2.5  # 12.5 − 10.0
    assert acc.ready(0, policy_version=1) is None  # applied: step 0 made version 1


def test_microsteps_counted_before_the_seal_count():
    acc = StepAccounts()
    acc.microstep_counted(3)
    acc.microstep_counted(3)
    assert acc.ready(3, policy_version=3) is None  # not sealed
    acc.seal(seal(3, microsteps=2))
    assert acc.ready(3, policy_version=3) is not None
    assert acc.ready(3, policy_version=2) is not None  # an older trainer has not applied it either


def test_a_step_without_microsteps_is_ready_at_its_seal_and_lasts_zero():
    acc = StepAccounts()
    acc.seal(seal(1, microsteps=0, executions=0))
    assert acc.ready(1, policy_version=1).executions == 0
    assert acc.duration_s(1, now=42.0) == 0.0


def test_sealed_steps_come_in_order_and_applied_means_version_above_step():
    acc = StepAccounts()
    for step in (5, 2, 3):
        acc.seal(seal(step, microsteps=1))
    assert acc.sealed_steps() == [2, 3, 5]
    assert (applied(0, 0), applied(0, 1), applied(4, 4), applied(4, 6)) == (False, True, False, True)
    assert weights_path(Path("/runs/r1/weights"), 3) == Path("/runs/r1/weights/v3")


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


def test_apply_step_of_a_step_without_microsteps_still_makes_a_version(model_dir, tmp_path):
    from gyre.learning.trainer import Trainer, TrainerConfig

    trainer = Trainer(model_dir, TrainerConfig())
    done = apply_step(trainer, executions=0, weights_dir=tmp_path)  # |E| = max(0, 1) = 1
    assert (done.policy_version, trainer.policy_version, done.path) == (1, 1, tmp_path / "v1")
    assert (done.stats.executions, done.stats.loss, done.stats.tokens) == (1, 0.0, 0)
    assert (done.path / "config.json").is_file() and (done.path / "model.safetensors").is_file()


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
    assert (done.path / "model.safetensors").is_file()
