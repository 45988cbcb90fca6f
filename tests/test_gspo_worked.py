"""GSPO against hand-worked numbers (DESIGN.md "Learning"), and a step's gradient under any
split into micro-steps and replicas.

The loss cases run `gspo_loss` on log-probs given directly (float64); the partition case
runs the real trainer (a tiny Qwen3 on CPU, float64) and the real replica path: each
replica accumulates its micro-steps, returns `gradients()` and its metrics, and the core
adds them (`add_gradients`), as the cells do over the transfer layer.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from gyre.learning.gspo import gspo_loss
from gyre.learning.metrics import StepMetrics
from gyre.trajectory.microstep import MicrostepData, Sample, pack
from gyre.trajectory.tree import Trajectory

T = torch.tensor
F64 = torch.float64


def one_trajectory(delta: float, adv: float, k: int = 2, eps: float = 0.2):
    """k trained tokens, each with log π_θ − log π_old = delta (so s = exp(delta)), N_e = k."""
    logp = torch.full((k,), -1.0, dtype=F64, requires_grad=True)
    behaviour = torch.full((k,), -1.0 - delta, dtype=F64)
    loss, stats = gspo_loss(logp, behaviour, torch.ones(k, dtype=torch.bool), torch.zeros(k, dtype=torch.long),
                            T([adv], dtype=F64), T([float(k)], dtype=F64), eps_low=eps, eps_high=eps)
    loss.backward()
    return loss.item(), logp.grad.tolist(), stats


# s = exp(δ); per token the objective is min(s·A, clip(s, 0.8, 1.2)·A), weight 1/N_e = 1/2, two
# tokens, so loss = −min(...); the gradient per token is −(1/2)·A·s when unclipped, else 0.
@pytest.mark.parametrize("delta,adv,loss,grad,clipped", [
    # A > 0, s = e^0.1 = 1.1051709 inside [0.8, 1.2]: loss −1.1051709, grad −0.5·1.1051709
    (0.1, 1.0, -1.1051709, -0.5525855, 0),
    # A > 0, s = e^0.3 = 1.3498588 > 1.2: min(1.3499, 1.2) = 1.2 → clipped, loss −1.2, grad 0
    (0.3, 1.0, -1.2, 0.0, 2),
    # A > 0, s = e^−0.3 = 0.7408182 < 0.8: min(0.7408, 0.8) = 0.7408 → not clipped (pessimistic side)
    (-0.3, 1.0, -0.7408182, -0.3704091, 0),
    # A < 0, s = e^−0.3: min(−0.7408, −0.8) = −0.8 → clipped, loss +0.8, grad 0
    (-0.3, -1.0, 0.8, 0.0, 2),
    # A < 0, s = e^0.3: min(−1.3499, −1.2) = −1.3499 → not clipped, loss +1.3498588, grad +0.5·1.3498588
    (0.3, -1.0, 1.3498588, 0.6749294, 0),
    # A < 0, s = e^0.1 inside: loss +1.1051709, grad +0.5525855
    (0.1, -1.0, 1.1051709, 0.5525855, 0),
])
def test_clipped_and_unclipped_for_both_advantage_signs(delta, adv, loss, grad, clipped):
    got_loss, got_grad, stats = one_trajectory(delta, adv)
    assert got_loss == pytest.approx(loss, abs=1e-6)
    assert got_grad == pytest.approx([grad, grad], abs=1e-6)
    assert stats["clipped"] == clipped
    assert stats["ratio_mean"] == pytest.approx(math.exp(delta))


def test_a_long_trajectory_with_many_masked_tokens_keeps_its_sequence_ratio():
    """2,000 positions of which 3 are trained, each with δ = 0.05 → s = e^0.05 = 1.0512711.
    The 1,997 masked positions carry garbage (behaviour 0 where π_θ is tiny, or −∞): were they
    in the mean, s would be e^(huge) or 0. A = 1, N_e = 3, ε = 0.2: loss = −1.0512711, each
    trained token's gradient −(1/3)·1.0512711 = −0.3504237, exactly as in a 3-token trajectory."""
    n = 2000
    rs = np.random.default_rng(0)
    logp = torch.as_tensor(rs.uniform(-30.0, -5.0, n), dtype=F64)
    behaviour = torch.zeros(n, dtype=F64)
    behaviour[::7] = float("-inf")
    trained = [17, 1000, 1999]
    mask = torch.zeros(n, dtype=torch.bool)
    mask[trained] = True
    logp[trained] = -2.0
    behaviour[trained] = -2.05
    logp.requires_grad_()
    loss, stats = gspo_loss(logp, behaviour, mask, torch.zeros(n, dtype=torch.long), T([1.0], dtype=F64),
                            T([3.0], dtype=F64), eps_low=0.2, eps_high=0.2)
    loss.backward()
    assert stats["ratio_mean"] == pytest.approx(1.0512711, abs=1e-7)
    assert loss.item() == pytest.approx(-1.0512711, abs=1e-7)
    expected = torch.zeros(n, dtype=F64)
    expected[trained] = -0.3504237
    assert torch.allclose(logp.grad, expected, atol=1e-7)
    short_loss, short_grad, _ = one_trajectory(0.05, 1.0, k=3)
    assert loss.item() == pytest.approx(short_loss, abs=1e-12)
    assert logp.grad[trained].tolist() == pytest.approx(short_grad, abs=1e-12)


@pytest.mark.parametrize("len_a,len_b", [(4, 4), (2, 8)])
def test_every_execution_weighs_the_same_whatever_its_length(len_a, len_b):
    """On policy (s = 1), execution A with A = +1 and len_a tokens, B with A = −1 and len_b
    tokens: each token's objective is A, weighted 1/N_e, so each execution contributes
    −A·N_e/N_e = −A: loss_sum = −1 + 1 = 0 for both (4, 4) and (2, 8). The gradient per token
    is −A/N_e: A's tokens −1/len_a, B's +1/len_b — an execution's total is ∓1 either way."""
    n = len_a + len_b
    logp = torch.linspace(-3.0, -1.0, n, dtype=F64).requires_grad_()
    seq = torch.tensor([0] * len_a + [1] * len_b)
    loss, _ = gspo_loss(logp, logp.detach().clone(), torch.ones(n, dtype=torch.bool), seq, T([1.0, -1.0], dtype=F64),
                        T([float(len_a), float(len_b)], dtype=F64), eps_low=0.2, eps_high=0.2)
    loss.backward()
    assert loss.item() == pytest.approx(0.0, abs=1e-12)
    assert logp.grad[:len_a].tolist() == pytest.approx([-1.0 / len_a] * len_a)
    assert logp.grad[len_a:].tolist() == pytest.approx([1.0 / len_b] * len_b)
    assert float(logp.grad[:len_a].sum()) == pytest.approx(-1.0) and float(logp.grad[len_a:].sum()) == pytest.approx(1.0)


# -- partition invariance on the real trainer ---------------------------------------------
VOCAB = 256


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = tmp_path_factory.mktemp("tiny-qwen3-partition")
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, intermediate_size=32, max_position_embeddings=256,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(out)
    return out


def _trajectory(execution: str, prefix: np.ndarray, n: int, seed: int) -> Trajectory:
    """`prefix` (shared with the execution's other trajectories), then n tokens of which
    every other one is trained, with behaviour log-probs off policy by a seeded amount."""
    rs = np.random.default_rng(seed)
    ids = np.concatenate([prefix, rs.integers(0, VOCAB, n)]).astype(np.int32)
    mask = np.zeros(ids.shape[0], dtype=bool)
    mask[prefix.shape[0] + 1::2] = True
    return Trajectory(execution=execution, leaf=f"{execution}:{seed}", role="main", input_ids=ids, loss_mask=mask,
                      behaviour_logprobs=np.where(mask, rs.uniform(-6.5, -4.5, ids.shape[0]), 0).astype(np.float32),
                      versions=np.where(mask, seed % 2, -1).astype(np.int32),
                      temperatures=np.where(mask, 0.9, 1.0).astype(np.float32))


def samples() -> list[Sample]:
    """Three executions, 7 trajectories of unequal lengths, some sharing a 70-token prefix."""
    rs = np.random.default_rng(7)
    shared = rs.integers(0, VOCAB, 70)
    return [Sample("A", 1.3, (_trajectory("A", shared, 30, 1), _trajectory("A", shared, 12, 2),
                              _trajectory("A", shared[:5], 40, 3))),
            Sample("B", -0.6, (_trajectory("B", shared, 9, 4), _trajectory("B", rs.integers(0, VOCAB, 3), 50, 5))),
            Sample("C", 0.4, (_trajectory("C", rs.integers(0, VOCAB, 20), 25, 6), _trajectory("C", shared, 16, 7)))]


def split(ms: MicrostepData, parts: int) -> list[MicrostepData]:
    """`ms` cut into `parts` micro-steps of consecutive trajectories (N_e stays the step's)."""
    bounds = np.linspace(0, ms.n_trajectories, parts + 1).round().astype(int)
    out = []
    for index, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        a, b = int(ms.cu_seqlens[lo]), int(ms.cu_seqlens[hi])
        used = sorted(set(ms.traj_execution[lo:hi].tolist()))
        remap = np.array([used.index(e) if e in used else -1 for e in range(len(ms.executions))], dtype=np.int32)
        out.append(dataclasses.replace(
            ms, index=index, executions=tuple(ms.executions[e] for e in used), input_ids=ms.input_ids[a:b],
            cu_seqlens=ms.cu_seqlens[lo:hi + 1] - a, loss_mask=ms.loss_mask[a:b],
            behaviour_logprobs=ms.behaviour_logprobs[a:b], temperatures=ms.temperatures[a:b],
            versions=ms.versions[a:b], traj_execution=remap[ms.traj_execution[lo:hi]],
            advantages=ms.advantages[lo:hi], n_e=ms.n_e[lo:hi], roles=ms.roles[lo:hi], leaves=ms.leaves[lo:hi]))
    return out


def _trainer(model_dir, replica: str):
    from gyre.learning.trainer import Trainer, TrainerConfig

    return Trainer(model_dir, TrainerConfig(dtype="float64", shared_prefix_min_tokens=16, replica=replica,
                                            eps_low=0.2, eps_high=0.2, lr=1e-2))


@pytest.fixture(scope="module")
def reference(model_dir):
    (whole,) = pack(samples(), 10**6, step=1)
    trainer = _trainer(model_dir, "cell0")
    trainer.accumulate(whole)
    return whole, trainer.gradients(), dataclasses.replace(trainer.metrics, per_replica={})


@pytest.mark.parametrize("parts", [1, 3, 7])
@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_any_split_into_microsteps_and_replicas_gives_the_same_gradient(model_dir, reference, parts, replicas):
    whole, expected, expected_metrics = reference
    assert whole.n_trajectories == 7 and float(np.abs(expected["model.embed_tokens.weight"]).sum()) > 1e-3
    microsteps = split(whole, parts)
    assert len(microsteps) == parts and sum(m.n_trained for m in microsteps) == whole.n_trained
    trainers = [_trainer(model_dir, f"cell{r}") for r in range(replicas)]
    for i, ms in enumerate(microsteps):
        trainers[i % replicas].accumulate(ms)
    core = trainers[0]
    for satellite in trainers[1:]:
        core.add_gradients(satellite.gradients(), StepMetrics.from_dict(satellite.metrics.to_dict()))
    got = core.gradients()
    assert set(got) == set(expected)
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=0, atol=1e-9, err_msg=name)
    m = core.metrics
    assert (m.tokens, m.trajectories, m.microsteps) == (expected_metrics.tokens, 7, parts)
    assert m.loss_sum == pytest.approx(expected_metrics.loss_sum, abs=1e-9)
    assert m.kl_sum == pytest.approx(expected_metrics.kl_sum, abs=1e-9)
    # Trajectory `seed` of n new tokens trains n // 2 of them, sampled by version seed % 2, trained
    # at step 1: staleness 0 for seeds 1, 3, 5, 7 (15 + 20 + 25 + 8), 1 for seeds 2, 4, 6 (6 + 4 + 12).
    assert m.staleness == expected_metrics.staleness == {"0": 68, "1": 22}
    assert sum(m.per_replica.values()) == parts and len(m.per_replica) == min(parts, replicas)
    stats = core.apply(num_executions=3)
    assert stats.metrics["microsteps"] == parts and stats.loss == pytest.approx(expected_metrics.loss_sum / 3, abs=1e-9)


def test_kl_estimate_and_step_metrics_merge_by_hand():
    """k3 per trained token, (r − 1) − log r with log r = δ: δ = 0.1 → 0.1051709 − 0.1 =
    0.0051709; δ = −0.2 → 0.8187308 − 1 + 0.2 = 0.0187308; two tokens of each: kl_sum =
    0.0478034. Two replicas' metrics merge into sums: ratios s = {1.2, 0.9} and {1.05}:
    mean 1.05, std √((1.44 + 0.81 + 1.1025)/3 − 1.05²) = √0.015 = 0.1224745."""
    logp = T([-1.0, -1.0, -2.0, -2.0], dtype=F64)
    behaviour = T([-1.1, -1.1, -1.8, -1.8], dtype=F64)
    _, stats = gspo_loss(logp, behaviour, torch.ones(4, dtype=torch.bool), T([0, 0, 1, 1]), T([1.0, 1.0], dtype=F64),
                         T([2.0, 2.0], dtype=F64))
    assert stats["kl_sum"] == pytest.approx(0.0478034, abs=1e-7)

    a, b = StepMetrics(), StepMetrics()
    a.add_microstep(dict(loss_sum=-0.6, tokens=6, trajectories=2, clipped=1.0, ratio_sum=2.1, ratio_sq_sum=2.25,
                         ratio_min=0.9, ratio_max=1.2, kl_sum=0.03), {0: 4, 1: 2}, "cell0")
    b.add_microstep(dict(loss_sum=0.2, tokens=4, trajectories=1, clipped=0.0, ratio_sum=1.05, ratio_sq_sum=1.1025,
                         ratio_min=1.05, ratio_max=1.05, kl_sum=0.02), {0: 4}, "cell1")
    b.add_time("forward_backward", 0.5)
    a.merge(StepMetrics.from_dict(b.to_dict()))
    s = a.summary(executions=4)
    assert s["loss"] == pytest.approx(-0.1) and s["clip_fraction"] == pytest.approx(0.1)  # −0.4/4, 1/10
    assert s["ratio_mean"] == pytest.approx(1.05) and s["ratio_std"] == pytest.approx(0.1224745, abs=1e-7)
    assert (s["ratio_min"], s["ratio_max"], s["kl"]) == (0.9, 1.2, pytest.approx(0.005))  # 0.05 / 10
    assert s["staleness_histogram"] == {"0": 8, "1": 2} and s["microsteps_per_replica"] == {"cell0": 1, "cell1": 1}
    assert s["phase_s"]["forward_backward"] == 0.5 and s["phase_s"]["checkpoint"] == 0.0
    empty = StepMetrics.from_dict(StepMetrics().to_dict())
    assert empty.summary(0)["ratio_min"] == 1.0 and empty.to_dict()["ratio_min"] is None
    with pytest.raises(ValueError, match="unknown phase"):
        a.add_time("lunch", 1.0)
