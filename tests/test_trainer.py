"""Trainer on a tiny Qwen3 (real vocabulary size, CPU): log-probs, GSPO step, weights."""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch

from gyre.microstep import Sample, from_bytes, pack, to_bytes
from gyre.trainer import Trainer, TrainerConfig
from gyre.trajectory import Trajectory

os.environ.setdefault("HF_HUB_OFFLINE", "1")
VOCAB = 151936


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = tmp_path_factory.mktemp("tiny-qwen3")
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=2048,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(out)
    return out


def traj(execution, n, trained_at, seed, temperature=1.0):
    rs = np.random.default_rng(seed)
    mask = np.zeros(n, dtype=bool)
    mask[trained_at] = True
    return Trajectory(
        execution=execution, leaf=f"{execution}:{seed}", role="main",
        input_ids=rs.integers(0, VOCAB, n).astype(np.int32), loss_mask=mask,
        behaviour_logprobs=np.where(mask, -20.0, 0).astype(np.float32),
        versions=np.where(mask, 0, -1).astype(np.int32),
        temperatures=np.where(mask, temperature, 1.0).astype(np.float32),
    )


def microstep(adv=(1.0, -0.5)):
    # Execution A: two trajectories (one at T = 0.7); execution B: one trajectory.
    a = Sample("A", adv[0], (traj("A", 12, [4, 5, 6, 9], 1), traj("A", 9, [3, 4, 8], 2, temperature=0.7)))
    b = Sample("B", adv[1], (traj("B", 10, [2, 3, 4, 5, 6], 3, temperature=1.3),))
    (ms,) = pack([a, b], 10_000)
    return ms


def on_policy(trainer, ms):
    return dataclasses.replace(ms, behaviour_logprobs=trainer.logprobs(ms))


def test_on_policy_ratio_is_one_and_gradient_is_finite(model_dir):
    trainer = Trainer(model_dir, TrainerConfig())
    ms = on_policy(trainer, microstep())
    stats = trainer.accumulate(ms)
    assert stats["ratio_min"] == pytest.approx(1.0, abs=1e-6) and stats["ratio_max"] == pytest.approx(1.0, abs=1e-6)
    assert stats["tokens"] == 12 and stats["trajectories"] == 3 and stats["clipped"] == 0
    # On policy each trajectory contributes −A·|K|/N_e: A: −1·(4 + 3)/7, B: +0.5·5/5 → −0.5.
    assert stats["loss_sum"] == pytest.approx(-0.5, abs=1e-5)
    before = trainer.state_dict_hash()
    step = trainer.apply(num_executions=2)
    assert step.loss == pytest.approx(-0.25, abs=1e-5)
    assert np.isfinite(step.grad_norm) and step.grad_norm > 0
    assert step.tokens == 12 and step.microsteps == 1 and step.executions == 2 and not step.skipped
    assert step.policy_version == 1 == trainer.policy_version
    assert trainer.state_dict_hash() != before  # weights changed with weight_decay 0
    assert all(p.grad is None for p in trainer.model.parameters())


def test_head_at_loss_positions_equals_full_head(model_dir):
    trainer = Trainer(model_dir, TrainerConfig())
    ms = microstep()
    got = trainer.logprobs(ms)
    with torch.no_grad():
        for i in range(ms.n_trajectories):
            a, b = int(ms.cu_seqlens[i]), int(ms.cu_seqlens[i + 1])
            ids = torch.as_tensor(ms.input_ids[a:b], dtype=torch.long)
            logits = trainer.model(input_ids=ids[None]).logits[0]  # (L, V)
            temps = torch.as_tensor(ms.temperatures[a:b])
            full = torch.log_softmax(logits[:-1] / temps[1:, None], dim=-1).gather(1, ids[1:, None])[:, 0]
            pos = np.flatnonzero(ms.loss_mask[a:b])
            np.testing.assert_allclose(got[a + pos], full.numpy()[pos - 1], atol=2e-5)
    assert (got[~ms.loss_mask] == 0).all()


def test_chunked_head_gives_the_same_gradient(model_dir):
    ms = microstep()
    whole = Trainer(model_dir, TrainerConfig(behaviour_logprobs="recompute"))
    chunked = Trainer(model_dir, TrainerConfig(behaviour_logprobs="recompute", head_chunk_tokens=2))
    s1, s2 = whole.accumulate(ms), chunked.accumulate(ms)
    assert s1["loss_sum"] == pytest.approx(s2["loss_sum"], abs=1e-6)
    for p, q in zip(whole.model.parameters(), chunked.model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=2e-5, rtol=1e-4)


def test_zero_advantages_give_zero_gradient(model_dir):
    trainer = Trainer(model_dir, TrainerConfig())
    trainer.accumulate(on_policy(trainer, microstep(adv=(0.0, 0.0))))
    assert all(p.grad is None or p.grad.abs().max() == 0 for p in trainer.model.parameters())
    before = trainer.state_dict_hash()
    step = trainer.apply(2)
    assert step.grad_norm == 0.0 and trainer.state_dict_hash() == before


def test_gradients_are_divided_by_num_executions(model_dir):
    ms = from_bytes(to_bytes(microstep()))  # via the wire format
    one, two = (Trainer(model_dir, TrainerConfig(behaviour_logprobs="recompute", grad_clip=1e9)) for _ in range(2))
    one.accumulate(ms)
    two.accumulate(ms)
    g1, g2 = one.apply(1).grad_norm, two.apply(2).grad_norm
    assert g1 == pytest.approx(2 * g2, rel=1e-6)


def test_recompute_ignores_recorded_logprobs(model_dir):
    trainer = Trainer(model_dir, TrainerConfig(behaviour_logprobs="recompute"))
    stats = trainer.accumulate(microstep())  # recorded log-probs are −20; the model gives ≈ −12
    assert stats["ratio_mean"] == pytest.approx(1.0)
    proxy = Trainer(model_dir, TrainerConfig()).accumulate(microstep())
    assert proxy["ratio_max"] > 2.0  # the proxy log-probs are used as π_old


def test_save_writes_a_loadable_checkpoint(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    trainer = Trainer(model_dir, TrainerConfig(), policy_version=4)
    trainer.accumulate(on_policy(trainer, microstep()))
    trainer.apply(2)
    out = trainer.save(tmp_path / "v5")
    assert (out / "model.safetensors").exists() and (out / "config.json").exists()
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, dtype=torch.float32)
    for (n, p), (m, q) in zip(trainer.model.state_dict().items(), loaded.state_dict().items()):
        assert n == m and torch.equal(p, q)
    assert trainer.policy_version == 5


def test_config_validation():
    with pytest.raises(ValueError, match="grad_clip"):
        TrainerConfig(grad_clip=0)
    with pytest.raises(ValueError, match="behaviour_logprobs"):
        TrainerConfig(behaviour_logprobs="guess")
    with pytest.raises(ValueError, match="lr"):
        TrainerConfig(lr=-1)


def test_head_logprobs_gradcheck_against_autograd():
    from gyre.trainer import head_logprobs

    torch.manual_seed(0)
    head = torch.nn.Linear(6, 11, bias=True).double()
    h = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([0, 3, 10, 3, 7])
    temps = torch.tensor([1.0, 0.7, 1.3, 1.0, 0.5], dtype=torch.float64)
    for chunk in (1, 2, 64):
        assert torch.autograd.gradcheck(
            lambda h, w, b: head_logprobs(_Lin(w, b), h, targets, temps, chunk),
            (h, head.weight, head.bias),
        )
    ref = torch.log_softmax(head(h) / temps[:, None], dim=-1).gather(1, targets[:, None])[:, 0]
    torch.testing.assert_close(head_logprobs(head, h, targets, temps, 2), ref)


class _Lin:
    def __init__(self, weight, bias):
        self.weight, self.bias = weight, bias


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu(model_dir):
    ms = microstep()
    cpu = Trainer(model_dir, TrainerConfig(behaviour_logprobs="recompute"))
    gpu = Trainer(model_dir, TrainerConfig(behaviour_logprobs="recompute", device="cuda"))
    np.testing.assert_allclose(gpu.logprobs(ms), cpu.logprobs(ms), atol=1e-4)
    s_cpu, s_gpu = cpu.accumulate(ms), gpu.accumulate(ms)
    assert s_gpu["loss_sum"] == pytest.approx(s_cpu["loss_sum"], abs=1e-4)
    a, b = cpu.apply(2), gpu.apply(2)
    assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-3)
