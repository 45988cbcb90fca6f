"""GSPO-token loss against hand-worked numbers (DESIGN.md "Learning", arXiv:2507.18071)."""
from __future__ import annotations

import math

import pytest
import torch

from gyre.learning.gspo import gspo_loss

T = torch.tensor


def case(adv_b=-0.5, eps=0.2):
    """Two trajectories in one micro-step.

    τ0 (execution A, A = +1, N_A = 2): positions 0..2, mask [0, 1, 1]
      logp [-5.0, -1.0, -2.0], behaviour [0, -1.1, -2.1] → deltas on K: 0.1, 0.1
      s0 = exp(0.1) = 1.1051709; in [0.8, 1.2] → objective per token 1.1051709
      contribution: −(1/2)·2·1.1051709 = −1.1051709
    τ1 (execution B, A = adv_b, N_B = 3, one of B's tokens sits in another micro-step):
      positions 3..5, mask [1, 1, 0], logp [-0.5, -1.5, -3.0], behaviour [-1.0, -2.0, -9.0]
      deltas on K: 0.5, 0.5 → s1 = exp(0.5) = 1.6487213
      A = −0.5: min(1.6487·−0.5, 1.2·−0.5) = min(−0.8243606, −0.6) = −0.8243606 (not clipped)
      contribution: −(1/3)·2·(−0.8243606) = +0.5495738
    loss_sum = −1.1051709 + 0.5495738 = −0.5555971
    """
    logp = T([-5.0, -1.0, -2.0, -0.5, -1.5, -3.0], dtype=torch.float64, requires_grad=True)
    behaviour = T([0.0, -1.1, -2.1, -1.0, -2.0, -9.0], dtype=torch.float64)
    mask = T([0, 1, 1, 1, 1, 0], dtype=torch.bool)
    seq = T([0, 0, 0, 1, 1, 1])
    adv = T([1.0, adv_b], dtype=torch.float64)
    n_e = T([2.0, 3.0], dtype=torch.float64)
    loss, stats = gspo_loss(logp, behaviour, mask, seq, adv, n_e, eps_low=eps, eps_high=eps)
    return logp, loss, stats


def test_hand_worked_loss_and_stats():
    _, loss, stats = case()
    assert loss.item() == pytest.approx(-0.5555971, abs=1e-6)
    assert stats["tokens"] == 4 and stats["trajectories"] == 2 and stats["clipped"] == 0
    assert stats["ratio_min"] == pytest.approx(math.exp(0.1))
    assert stats["ratio_max"] == pytest.approx(math.exp(0.5))


def test_gradient_matches_analytic():
    # d loss / d logp_t = −(1/N_e)·A·s_τ on unclipped trained positions, 0 elsewhere:
    # τ0: −(1/2)·1·1.1051709 = −0.5525855; τ1: −(1/3)·(−0.5)·1.6487213 = +0.2747869
    logp, loss, _ = case()
    loss.backward()
    expected = [0.0, -0.5525855, -0.5525855, 0.2747869, 0.2747869, 0.0]
    assert logp.grad.tolist() == pytest.approx(expected, abs=1e-6)


def test_clipping_zeroes_the_gradient():
    # A_B = +0.5: min(1.6487·0.5, 1.2·0.5) = 0.6 → clipped constant, gradient 0 on τ1.
    # loss = −1.1051709 − (1/3)·2·0.6 = −1.5051709
    logp, loss, stats = case(adv_b=0.5)
    assert loss.item() == pytest.approx(-1.5051709, abs=1e-6)
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([0.0, -0.5525855, -0.5525855, 0.0, 0.0, 0.0], abs=1e-6)
    assert stats["clipped"] == 2


def test_negative_advantage_clips_low_ratio():
    # s = exp(−0.5) = 0.6065 < 1 − 0.2 with A = −1: min(−0.6065, −0.8) = −0.8 → clipped, no gradient.
    logp = T([0.0, -1.5], dtype=torch.float64, requires_grad=True)
    loss, stats = gspo_loss(logp, T([0.0, -1.0], dtype=torch.float64), T([False, True]), T([0, 0]),
                            T([-1.0], dtype=torch.float64), T([1.0], dtype=torch.float64), eps_low=0.2, eps_high=0.2)
    assert loss.item() == pytest.approx(0.8)
    loss.backward()
    assert logp.grad.tolist() == [0.0, 0.0]
    assert stats["clipped"] == 1


def test_default_eps_on_policy():
    # On policy (logp == behaviour): s = 1, objective = A per token; loss = −Σ_τ A·|K_τ|/N_e.
    # A = 2, |K| = 3, N = 4 → −1.5; gradient −A/N = −0.5 per trained position.
    logp = T([-1.0, -2.0, -3.0, -4.0], requires_grad=True)
    loss, stats = gspo_loss(logp, logp.detach().clone(), T([False, True, True, True]), T([0, 0, 0, 0]),
                            T([2.0]), T([4.0]))
    assert loss.item() == pytest.approx(-1.5)
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([0.0, -0.5, -0.5, -0.5])
    assert stats["ratio_mean"] == 1.0


def test_gradient_equals_finite_difference_of_sequence_ratio():
    # In the trust region the GSPO-token gradient equals the gradient of the sequence-level
    # objective −(|K|/N)·A·s(θ), s = exp(mean Δ), because ∂s/∂logp_t = s/|K|.
    torch.manual_seed(0)
    logp = (torch.randn(5, dtype=torch.float64) * 1e-5 - 1.0).requires_grad_()
    behaviour = torch.full((5,), -1.0, dtype=torch.float64)
    mask, seq, adv, n_e = torch.ones(5, dtype=torch.bool), torch.zeros(5, dtype=torch.long), T([0.7], dtype=torch.float64), T([5.0], dtype=torch.float64)
    loss, _ = gspo_loss(logp, behaviour, mask, seq, adv, n_e, eps_low=0.1, eps_high=0.1)
    loss.backward()

    def seq_obj(lp):
        return -(5 / 5.0) * 0.7 * torch.exp((lp - behaviour).mean())

    h = 1e-6
    for t in range(5):
        e = torch.zeros(5, dtype=torch.float64)
        e[t] = h
        fd = (seq_obj(logp.detach() + e) - seq_obj(logp.detach() - e)) / (2 * h)
        assert float(logp.grad[t]) == pytest.approx(float(fd), rel=1e-6)


def test_duplicating_an_execution_keeps_its_weight():
    # Same per-token ratios, twice the tokens (and twice N_e): same contribution, same ratio.
    lp1 = T([-1.0, -0.9, -2.0])
    b1 = T([-1.0, -1.0, -2.2])
    m1 = T([False, True, True])
    one, s_one = gspo_loss(lp1, b1, m1, T([0, 0, 0]), T([0.8]), T([2.0]), eps_low=0.5, eps_high=0.5)
    two, s_two = gspo_loss(torch.cat([lp1, lp1]), torch.cat([b1, b1]), torch.cat([m1, m1]), T([0, 0, 0, 0, 0, 0]),
                           T([0.8]), T([4.0]), eps_low=0.5, eps_high=0.5)
    assert one.item() == pytest.approx(two.item())
    assert s_one["ratio_mean"] == pytest.approx(s_two["ratio_mean"])
    # Split into two trajectories of the same execution: still the same contribution.
    split, _ = gspo_loss(torch.cat([lp1, lp1]), torch.cat([b1, b1]), torch.cat([m1, m1]), T([0, 0, 0, 1, 1, 1]),
                         T([0.8, 0.8]), T([4.0, 4.0]), eps_low=0.5, eps_high=0.5)
    assert split.item() == pytest.approx(one.item())


def test_masked_tokens_never_enter_the_ratio_and_empty_trajectory_is_harmless():
    # τ1 has no trained position and N_e = 0; masked behaviour is −inf garbage.
    logp = T([-1.0, -1.0, -7.0, -8.0], requires_grad=True)
    behaviour = T([-1.0, -1.0, float("-inf"), float("-inf")])
    loss, stats = gspo_loss(logp, behaviour, T([False, True, False, False]), T([0, 0, 1, 1]),
                            T([1.0, 3.0]), T([1.0, 0.0]))
    assert loss.item() == pytest.approx(-1.0)
    loss.backward()
    assert torch.isfinite(logp.grad).all()
    assert logp.grad.tolist() == pytest.approx([0.0, -1.0, 0.0, 0.0])
    assert stats["trajectories"] == 1


def test_zero_advantage_gives_zero_gradient():
    logp = T([-1.0, -2.0], requires_grad=True)
    loss, _ = gspo_loss(logp, T([-1.5, -2.5]), T([True, True]), T([0, 0]), T([0.0]), T([2.0]))
    loss.backward()
    assert loss.item() == 0.0 and logp.grad.abs().sum() == 0


def test_shape_mismatch_raises():
    with pytest.raises(ValueError):
        gspo_loss(T([0.0, 0.0]), T([0.0]), T([True, True]), T([0, 0]), T([1.0]), T([1.0]))
