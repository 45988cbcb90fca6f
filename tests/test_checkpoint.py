"""The core's checkpoints (gyre.learning.checkpoint): a restored trainer goes on exactly as
the one that saved it (float64, a tiny Qwen3 on CPU)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gyre.learning import checkpoint
from gyre.learning.trainer import Trainer, TrainerConfig
from tests.test_gspo_worked import model_dir, samples  # noqa: F401 - the fixture
from gyre.trajectory.microstep import pack

CFG = TrainerConfig(dtype="float64", lr=5e-2, eps_low=0.2, eps_high=0.2, shared_prefix_min_tokens=16)


def train_step(trainer: Trainer, step: int) -> None:
    for ms in pack(samples(), 200, step=step):
        trainer.accumulate(ms)
    trainer.apply(num_executions=3)


def test_a_restored_trainer_continues_exactly(model_dir, tmp_path):  # noqa: F811
    trainer = Trainer(model_dir, CFG)
    train_step(trainer, 0)
    train_step(trainer, 1)
    torch.manual_seed(1234)
    path = checkpoint.save(trainer, tmp_path, extra={"completed": {"step": 1}})
    assert path == tmp_path / "v2" and checkpoint.latest(tmp_path) == path
    assert {"config.json", "model.safetensors", "optimizer.safetensors", "trainer_state.json"} <= {
        p.name for p in path.iterdir()}
    expected_rng = torch.get_rng_state()

    torch.manual_seed(0)  # whatever happened since, restore brings the saved RNG back
    restored, state = checkpoint.restore(path, CFG)
    assert torch.equal(torch.get_rng_state(), expected_rng)
    assert state["extra"] == {"completed": {"step": 1}} and state["lr_schedule"] == {
        "name": "constant", "lr": 5e-2, "optimizer_steps": 2}
    assert restored.policy_version == 2
    for (name, p), (_, q) in zip(trainer.model.named_parameters(), restored.model.named_parameters()):
        assert torch.equal(p, q), name
        mine, theirs = trainer.optimizer.state[p], restored.optimizer.state[q]
        assert set(mine) == set(theirs) == {"step", "exp_avg", "exp_avg_sq"}
        for key in mine:
            assert torch.equal(torch.as_tensor(mine[key]), torch.as_tensor(theirs[key])), (name, key)
    assert float(restored.optimizer.state[next(restored.model.parameters())]["exp_avg_sq"].abs().sum()) > 0

    train_step(trainer, 2)
    train_step(restored, 2)
    for name, a in trainer.weights().items():
        np.testing.assert_allclose(restored.weights()[name], a, rtol=0, atol=1e-12, err_msg=name)


def test_latest_is_the_newest_complete_checkpoint(model_dir, tmp_path):  # noqa: F811
    assert checkpoint.latest(tmp_path / "none") is None
    trainer = Trainer(model_dir, CFG, policy_version=3)
    checkpoint.save(trainer, tmp_path)
    (tmp_path / "v7").mkdir()  # written only in part: no trainer_state.json
    (tmp_path / ".v5.partial").mkdir()
    assert checkpoint.latest(tmp_path) == tmp_path / "v3"
    (tmp_path / "v3" / "trainer_state.json").write_text('{"format": "other"}')
    with pytest.raises(ValueError, match="not a gyre.checkpoint.v1"):
        checkpoint.restore(tmp_path / "v3", CFG)


def test_an_offloaded_core_trainer_comes_back_bit_for_bit_with_its_step_in_flight(model_dir, tmp_path):  # noqa: F811
    """gyre.learning.offload: after a step (checkpointed, as the core does) and half of the next
    one accumulated, offload then restore gives the same weights, AdamW state, gradient and
    metrics; both finish the step to the same weights."""
    from gyre.learning import offload
    from gyre.learning.steps import apply_step

    trainer = Trainer(model_dir, CFG)
    for ms in pack(samples(), 200, step=0):
        trainer.accumulate(ms)
    apply_step(trainer, 3, tmp_path)
    half = pack(samples(), 200, step=1)
    for ms in half[: len(half) // 2 or 1]:
        trainer.accumulate(ms)
    assert offload.offload(trainer, tmp_path) > 0
    back = offload.restore(tmp_path, model_dir, CFG, version=1)
    assert back.policy_version == 1 and back.metrics == trainer.metrics
    mine, theirs = dict(trainer.model.named_parameters()), dict(back.model.named_parameters())
    for name, p in mine.items():
        q = theirs[name]
        assert torch.equal(p, q) and (p.grad is None) == (q.grad is None), name
        assert p.grad is None or torch.equal(p.grad, q.grad), name
        for key, value in trainer.optimizer.state[p].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(back.optimizer.state[q][key])), (name, key)
    for t in (trainer, back):
        for ms in half[len(half) // 2 or 1:]:
            t.accumulate(ms)
        t.apply(3)
    for name, a in trainer.weights().items():
        assert np.array_equal(back.weights()[name], a), name
    with pytest.raises(RuntimeError, match="no checkpoint of policy version 2"):
        offload.restore(tmp_path, model_dir, CFG, version=2)
    checkpoint.save(trainer, tmp_path)  # v2 on disk; the step file is still v1's
    with pytest.raises(RuntimeError, match="a step of policy version 1, not 2"):
        offload.restore(tmp_path, model_dir, CFG, version=2)
    trainer.discard()
    assert offload.offload(trainer, tmp_path) == 0 and not (tmp_path / offload.STEP_FILE).exists()
    fresh = offload.restore(tmp_path, model_dir, CFG, version=2)
    assert fresh.metrics.microsteps == 0 and all(p.grad is None for p in fresh.model.parameters())
