"""GSPO loss of one packed micro-step (DESIGN.md "Learning").

Group Sequence Policy Optimization, Zheng et al. 2025 (arXiv:2507.18071), GSPO-token form
(their eq. 10–11), in the execution-averaged form of DESIGN.md. For trajectory τ of
execution e with trained positions K_τ:

    s_τ   = exp( (1/|K_τ|) Σ_{t∈K_τ} (log π_θ(y_t) − log π_old(y_t)) )
    r_τ,t = sg[s_τ] · π_θ(y_t) / sg[π_θ(y_t)]          value s_τ, gradient s_τ·∇log π_θ(y_t)
    loss_sum = −Σ_τ (1/N_e) Σ_{t∈K_τ} min(r_τ,t·A_e, clip(r_τ,t, 1−ε_low, 1+ε_high)·A_e)

The micro-step loss is a *sum over executions*: the full step loss is
L = loss_sum_total / |E|, and |E| is only known when the step is sealed, so the trainer
accumulates gradients of loss_sum over micro-steps and divides them by |E| before the
optimizer step. N_e counts the execution's trained tokens over the whole step, so the
per-micro-step sums add up exactly.

Masked positions never enter s_τ; a trajectory with |K_τ| = 0 contributes nothing (no NaN).
log s_τ is clamped to ±`MAX_LOG_RATIO` so a pathological ratio cannot turn into inf.
"""
from __future__ import annotations

import torch

MAX_LOG_RATIO = 20.0


def gspo_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    loss_mask: torch.Tensor,
    seq_index: torch.Tensor,
    advantages: torch.Tensor,
    n_e: torch.Tensor,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Summed GSPO-token loss of one micro-step.

    logp: (T,) float, log π_θ(y_t) of the temperature-scaled distribution (natural log),
      differentiable. behaviour_logp: (T,) float, log π_old(y_t) (no gradient taken).
    loss_mask: (T,) bool, True on K_τ. seq_index: (T,) int64, trajectory of each position
      in [0, n_traj). advantages: (n_traj,) float, A_e of each trajectory's execution.
    n_e: (n_traj,) float, N_e of each trajectory's execution (trained tokens of that
      execution over the whole step; ≥ |K_τ|).
    Returns (loss_sum, stats): loss_sum a scalar tensor (divide by |E| for the step loss);
      stats with python floats: `tokens` (Σ|K_τ|), `trajectories` (with |K_τ| > 0),
      `clipped` (positions whose gradient the clip removed), `ratio_mean`/`ratio_min`/
      `ratio_max` (of s_τ over non-empty trajectories), `ratio_sum`/`ratio_sq_sum` (Σ s_τ,
      Σ s_τ² over them), `log_ratio_abs_max`, and `kl_sum`: Σ over trained tokens of the k3
      estimate (r − 1) − log r, r = π_θ(y_t)/π_old(y_t) (gyre.learning.metrics).
    Raises ValueError when shapes disagree.
    """
    T = logp.shape[0]
    n_traj = advantages.shape[0]
    for name, t in (("behaviour_logp", behaviour_logp), ("loss_mask", loss_mask), ("seq_index", seq_index)):
        if t.shape != (T,):
            raise ValueError(f"{name} must have shape ({T},), got {tuple(t.shape)}")
    if n_e.shape != (n_traj,):
        raise ValueError(f"n_e must have shape ({n_traj},), got {tuple(n_e.shape)}")
    mask = loss_mask.to(torch.bool)
    seq = seq_index.to(torch.long)
    dtype = logp.dtype
    maskf = mask.to(dtype)
    zero = torch.zeros((), dtype=dtype, device=logp.device)

    # Sequence-level ratio s_τ over trained positions only.
    delta = torch.where(mask, logp.detach() - behaviour_logp.to(dtype), zero)  # (T,)
    k = torch.zeros(n_traj, dtype=dtype, device=logp.device).index_add_(0, seq, maskf)  # (n_traj,)
    sum_delta = torch.zeros(n_traj, dtype=dtype, device=logp.device).index_add_(0, seq, delta)
    log_s = (sum_delta / k.clamp(min=1.0)).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)  # (n_traj,)
    s = torch.exp(log_s)  # (n_traj,), no gradient

    # GSPO-token ratio: value s_τ, gradient through the token's own log-prob.
    r = s[seq] * torch.exp(logp - logp.detach())  # (T,)
    adv = advantages.to(dtype)[seq]  # (T,)
    clipped_r = torch.clamp(r, 1.0 - eps_low, 1.0 + eps_high)
    objective = torch.minimum(r * adv, clipped_r * adv)  # (T,)
    weight = torch.where(mask, 1.0 / n_e.to(dtype).clamp(min=1.0)[seq], zero)  # (T,)
    loss_sum = -(objective * weight).sum()

    with torch.no_grad():
        rd = r.detach()
        clipped = mask & (((adv > 0) & (rd > 1.0 + eps_high)) | ((adv < 0) & (rd < 1.0 - eps_low)))
        live = k > 0
        s_live = s[live]
        stats = {
            "tokens": float(k.sum()),
            "trajectories": float(live.sum()),
            "clipped": float(clipped.sum()),
            "ratio_mean": float(s_live.mean()) if s_live.numel() else 1.0,
            "ratio_min": float(s_live.min()) if s_live.numel() else 1.0,
            "ratio_max": float(s_live.max()) if s_live.numel() else 1.0,
            "ratio_sum": float(s_live.sum()),
            "ratio_sq_sum": float((s_live * s_live).sum()),
            "log_ratio_abs_max": float(log_s[live].abs().max()) if s_live.numel() else 0.0,
        }
        log_r = delta.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)  # (T,), 0 off K_τ: contributes 0
        stats["kl_sum"] = float(torch.where(mask, torch.expm1(log_r) - log_r, zero).sum())
    return loss_sum, stats
