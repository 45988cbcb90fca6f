"""Streaming GSPO trainer on torch: accumulate micro-steps, then one optimizer step.

Contract:
- `Trainer(model_dir, cfg)` loads an HF causal LM from a local directory (float32, train
  mode) with AdamW. `policy_version` is the version of its current weights.
- `accumulate(ms)` runs forward-backward on one micro-step and adds the gradient of the
  micro-step's *summed* GSPO loss (`gyre.gspo`); the weights do not change, so every
  micro-step of a step sees the same policy. Trajectories are run one at a time (each with
  positions from 0), the sequence is cut after its last loss position, and the output head
  runs only at the positions that predict a trained token (hidden state at t − 1), in
  chunks whose logits are recomputed in backward, so the 151,936-wide head never
  materialises for the whole sequence.
- `apply(num_executions)` divides the accumulated gradients by |E| (DESIGN.md "Learning":
  L = (1/|E|) Σ_e ...), clips the global norm, steps AdamW, zeroes gradients and increments
  `policy_version`.
- `save(out_dir)` writes an HF checkpoint (config.json + model.safetensors, tokenizer files
  copied from the source directory) that an engine can load.

Log-probs are of the temperature-scaled distribution log_softmax(logits / T_t), T_t the
sampling temperature of the call that produced the token, before top-p/top-k.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import shutil
from pathlib import Path
from typing import Literal

import numpy as np
import structlog
import torch

from gyre.gspo import gspo_loss
from gyre.microstep import MicrostepData

log = structlog.get_logger()

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TrainerConfig:
    """Optimizer and loss settings of a trainer replica.

    lr: AdamW learning rate. betas, adam_eps: AdamW moments and denominator epsilon.
    weight_decay: decoupled weight decay (0 = none). grad_clip: max global L2 norm, > 0.
    eps_low, eps_high: GSPO clip range (Zheng et al. 2025 defaults).
    behaviour_logprobs: `proxy` uses the log-probs the proxy recorded as π_old;
      `recompute` uses the trainer's own log-probs under the step's (fixed) weights.
    head_chunk_tokens: loss positions per output-head chunk (bounds the (K, V) logits).
    device: torch device string. seed: torch seed set at construction.
    """

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    eps_low: float = 3e-4
    eps_high: float = 4e-4
    behaviour_logprobs: Literal["proxy", "recompute"] = "proxy"
    head_chunk_tokens: int = 512
    device: str = "cpu"
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"TrainerConfig.lr must be > 0, got {self.lr}")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"TrainerConfig.betas must be in [0, 1), got {self.betas}")
        if self.weight_decay < 0:
            raise ValueError(f"TrainerConfig.weight_decay must be >= 0, got {self.weight_decay}")
        if not self.grad_clip > 0:
            raise ValueError(f"TrainerConfig.grad_clip must be > 0, got {self.grad_clip}")
        if not (0 < self.eps_low < 1 and self.eps_high > 0):
            raise ValueError(f"TrainerConfig.eps_low must be in (0, 1) and eps_high > 0, got {self.eps_low}, {self.eps_high}")
        if self.behaviour_logprobs not in ("proxy", "recompute"):
            raise ValueError(f"TrainerConfig.behaviour_logprobs must be 'proxy' or 'recompute', got {self.behaviour_logprobs!r}")
        if self.head_chunk_tokens < 1:
            raise ValueError(f"TrainerConfig.head_chunk_tokens must be >= 1, got {self.head_chunk_tokens}")


@dataclasses.dataclass(frozen=True, slots=True)
class StepStats:
    """Outcome of one optimizer step.

    loss: step loss L = Σ micro-step loss sums / |E|. grad_norm: global L2 norm of the
    |E|-scaled gradient before clipping. tokens: trained positions. trajectories,
    microsteps: accumulated. executions: |E| as passed. clipped_fraction: trained positions
    whose gradient the GSPO clip removed. policy_version: version after the step.
    skipped: True when the gradient was not finite and the update was not applied.
    """

    loss: float
    grad_norm: float
    tokens: int
    trajectories: int
    microsteps: int
    executions: int
    clipped_fraction: float
    policy_version: int
    skipped: bool = False


class Trainer:
    """One training replica: a model, its AdamW state, and the step being accumulated.

    Raises OSError (from transformers) when model_dir holds no loadable checkpoint.
    """

    def __init__(self, model_dir: str | Path, cfg: TrainerConfig = TrainerConfig(), *, policy_version: int = 0) -> None:
        from transformers import AutoModelForCausalLM

        self.cfg = cfg
        self.model_dir = Path(model_dir)
        self.policy_version = policy_version
        torch.manual_seed(cfg.seed)
        self.device = torch.device(cfg.device)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, local_files_only=True, dtype=torch.float32)
        self.model.to(self.device)
        self.model.train()
        self._decoder = getattr(self.model, self.model.base_model_prefix)
        self._head = self.model.get_output_embeddings()
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.adam_eps, weight_decay=cfg.weight_decay,
        )
        self._reset_step()

    def _reset_step(self) -> None:
        self._loss_sum = 0.0
        self._tokens = 0
        self._trajectories = 0
        self._microsteps = 0
        self._clipped = 0.0

    # -- log-probs --------------------------------------------------------------------
    def _trajectory_logprobs(self, ids: torch.Tensor, pos: torch.Tensor, temps: torch.Tensor) -> torch.Tensor:
        """(K,) log π(ids[pos]) for one trajectory; pos ≥ 1 sorted, temps (K,) per position."""
        last = int(pos[-1])
        inputs = ids[:last].unsqueeze(0)  # (1, L) — positions after the last target are never needed
        positions = torch.arange(last, device=self.device).unsqueeze(0)
        hidden = self._decoder(input_ids=inputs, position_ids=positions, use_cache=False).last_hidden_state[0]  # (L, H)
        h = hidden.index_select(0, pos - 1)  # (K, H)
        targets = ids.index_select(0, pos)  # (K,)
        return head_logprobs(self._head, h, targets, temps, self.cfg.head_chunk_tokens)

    @torch.no_grad()
    def logprobs(self, ms: MicrostepData) -> np.ndarray:
        """(T,) float32 log-probs of the current weights at `ms`'s loss positions, 0 elsewhere."""
        out = np.zeros(ms.n_tokens, dtype=np.float32)
        ids = torch.as_tensor(ms.input_ids, dtype=torch.long, device=self.device)
        temps_all = torch.as_tensor(ms.temperatures, dtype=torch.float32, device=self.device)
        for _, a, b, pos in _loss_positions(ms):
            lp = self._trajectory_logprobs(ids[a:b], torch.as_tensor(pos, device=self.device), temps_all[a:b][pos])
            out[a + pos] = lp.float().cpu().numpy()
        return out

    # -- training ---------------------------------------------------------------------
    def accumulate(self, ms: MicrostepData) -> dict[str, float]:
        """Forward-backward on one micro-step; gradients add up until `apply`.

        Returns stats: `loss_sum` (this micro-step's summed loss, before 1/|E|), `tokens`,
        `trajectories`, `clipped`, `ratio_mean`, `ratio_min`, `ratio_max`.
        """
        ids = torch.as_tensor(ms.input_ids, dtype=torch.long, device=self.device)
        temps_all = torch.as_tensor(ms.temperatures, dtype=torch.float32, device=self.device)
        behaviour_all = torch.as_tensor(ms.behaviour_logprobs, dtype=torch.float32, device=self.device)
        adv = torch.as_tensor(ms.advantages, dtype=torch.float32, device=self.device)
        n_e = torch.as_tensor(ms.n_e, dtype=torch.float32, device=self.device)
        loss_sum, tokens, trajs, clipped = 0.0, 0.0, 0.0, 0.0
        ratios: list[float] = []
        rmin, rmax = math.inf, -math.inf
        for i, a, b, pos_np in _loss_positions(ms):
            pos = torch.as_tensor(pos_np, device=self.device)
            logp = self._trajectory_logprobs(ids[a:b], pos, temps_all[a:b][pos])  # (K,)
            behaviour = logp.detach() if self.cfg.behaviour_logprobs == "recompute" else behaviour_all[a:b][pos]
            k = logp.shape[0]
            loss, st = gspo_loss(
                logp, behaviour, torch.ones(k, dtype=torch.bool, device=self.device),
                torch.zeros(k, dtype=torch.long, device=self.device), adv[i:i + 1], n_e[i:i + 1],
                eps_low=self.cfg.eps_low, eps_high=self.cfg.eps_high,
            )
            if float(adv[i]) != 0.0 and st["clipped"] < st["tokens"]:
                loss.backward()  # otherwise the gradient is exactly zero: skip the backward pass
            loss_sum += float(loss.detach())
            tokens += st["tokens"]
            trajs += st["trajectories"]
            clipped += st["clipped"]
            ratios.append(st["ratio_mean"])
            rmin, rmax = min(rmin, st["ratio_min"]), max(rmax, st["ratio_max"])
        self._loss_sum += loss_sum
        self._tokens += int(tokens)
        self._trajectories += int(trajs)
        self._clipped += clipped
        self._microsteps += 1
        stats = {
            "loss_sum": loss_sum, "tokens": tokens, "trajectories": trajs, "clipped": clipped,
            "ratio_mean": float(np.mean(ratios)) if ratios else 1.0,
            "ratio_min": rmin if ratios else 1.0, "ratio_max": rmax if ratios else 1.0,
        }
        log.debug("trainer.microstep.accumulated", step=ms.step, microstep=ms.index, policy_version=self.policy_version, **stats)
        return stats

    def apply(self, num_executions: int) -> StepStats:
        """Seal the step: grads /= |E|, clip, AdamW step, zero grads, policy_version += 1.

        Raises ValueError when num_executions < 1.
        """
        if num_executions < 1:
            raise ValueError(f"num_executions (|E|) must be >= 1, got {num_executions}")
        params = [p for p in self.model.parameters() if p.grad is not None]
        for p in params:
            p.grad.div_(num_executions)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip)) if params else 0.0
        skipped = not math.isfinite(grad_norm)
        if skipped:
            log.warning("trainer.step.skipped", reason="non-finite gradient", grad_norm=grad_norm, policy_version=self.policy_version)
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.policy_version += 1
        stats = StepStats(
            loss=self._loss_sum / num_executions, grad_norm=grad_norm, tokens=self._tokens,
            trajectories=self._trajectories, microsteps=self._microsteps, executions=num_executions,
            clipped_fraction=self._clipped / self._tokens if self._tokens else 0.0,
            policy_version=self.policy_version, skipped=skipped,
        )
        self._reset_step()
        log.info("trainer.step.applied", **dataclasses.asdict(stats))
        return stats

    # -- weights ----------------------------------------------------------------------
    def save(self, out_dir: str | Path) -> Path:
        """Write config.json + model.safetensors (+ tokenizer files of the source) to out_dir."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(out, safe_serialization=True)
        for name in _TOKENIZER_FILES:
            src = self.model_dir / name
            if src.exists() and not (out / name).exists():
                shutil.copyfile(src, out / name)
        log.info("trainer.weights.saved", path=str(out), policy_version=self.policy_version)
        return out

    def state_dict_hash(self) -> str:
        """sha256 over the model's state dict (names, shapes, dtypes, bytes), for tests."""
        h = hashlib.sha256()
        for name, tensor in sorted(self.model.state_dict().items()):
            t = tensor.detach().cpu().contiguous()
            h.update(name.encode())
            h.update(str((tuple(t.shape), str(t.dtype))).encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        return h.hexdigest()


class _HeadLogprob(torch.autograd.Function):
    """log_softmax((h·Wᵀ + b) / T)[target] in row chunks, without keeping (K, V) logits.

    Forward keeps only h, W, targets, T and the (K,) log-normalisers; backward recomputes
    each chunk's logits once and forms d/dlogits = (onehot − softmax)·g / T in place. On a
    151,936-wide head this is several times faster than autograd through log_softmax and
    bounds memory by one (chunk, V) buffer.
    """

    @staticmethod
    def forward(ctx, h, weight, bias, targets, temps, chunk):
        K = h.shape[0]
        acc = _acc_dtype(weight)
        out = torch.empty(K, dtype=acc, device=h.device)
        lse = torch.empty(K, dtype=acc, device=h.device)
        for i in range(0, K, chunk):
            logits = _chunk_logits(h[i:i + chunk], weight, bias, temps[i:i + chunk])  # (k, V) float32
            lse[i:i + chunk] = torch.logsumexp(logits, dim=1)
            out[i:i + chunk] = logits.gather(1, targets[i:i + chunk, None])[:, 0] - lse[i:i + chunk]
        ctx.save_for_backward(h, weight, bias, targets, temps, lse)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx, grad_out):
        h, weight, bias, targets, temps, lse = ctx.saved_tensors
        chunk = ctx.chunk
        acc = _acc_dtype(weight)
        grad_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if ctx.needs_input_grad[1] else None
        grad_b = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if bias is not None and ctx.needs_input_grad[2] else None
        w_acc = weight.to(acc)
        for i in range(0, h.shape[0], chunk):
            hc, tc = h[i:i + chunk], temps[i:i + chunk, None].to(acc)
            g = grad_out[i:i + chunk, None].to(acc) / tc  # (k, 1)
            d = _chunk_logits(hc, weight, bias, temps[i:i + chunk])
            d.sub_(lse[i:i + chunk, None]).exp_().mul_(-g)  # −softmax·g/T
            d.scatter_add_(1, targets[i:i + chunk, None], g)  # + onehot·g/T
            if grad_h is not None:
                grad_h[i:i + chunk] = (d @ w_acc).to(h.dtype)
            if grad_w is not None:
                grad_w.addmm_(d.T, hc.to(acc))
            if grad_b is not None:
                grad_b += d.sum(0)
        grad_w = grad_w.to(weight.dtype) if grad_w is not None else None
        grad_b = grad_b.to(bias.dtype) if grad_b is not None else None
        return grad_h, grad_w, grad_b, None, None, None


def _acc_dtype(weight: torch.Tensor) -> torch.dtype:
    """Softmax arithmetic in float32 at least (float64 stays float64, for gradcheck)."""
    return torch.promote_types(weight.dtype, torch.float32)


def _chunk_logits(h, weight, bias, temps):
    acc = _acc_dtype(weight)
    logits = (h @ weight.T).to(acc)  # (k, V)
    if bias is not None:
        logits += bias.to(acc)
    return logits.div_(temps[:, None].to(acc))


def head_logprobs(head: torch.nn.Linear, h: torch.Tensor, targets: torch.Tensor, temps: torch.Tensor, chunk: int = 512) -> torch.Tensor:
    """(K,) log_softmax(head(h) / T)[target] (float32, or float64 for a float64 head),
    differentiable w.r.t. h and the head's weight and bias.

    h: (K, H) hidden states at the positions before the targets. targets: (K,) int64.
    temps: (K,) float sampling temperatures (> 0). chunk: rows per (chunk, V) logits buffer.
    """
    return _HeadLogprob.apply(h, head.weight, head.bias, targets, temps, chunk)


def _loss_positions(ms: MicrostepData):
    """Yield (trajectory, start, end, pos) per trajectory with ≥ 1 loss position; pos (K,) int64 local, ≥ 1."""
    cu = ms.cu_seqlens
    for i in range(ms.n_trajectories):
        a, b = int(cu[i]), int(cu[i + 1])
        pos = np.flatnonzero(ms.loss_mask[a:b])
        pos = pos[pos >= 1]  # position 0 has no context to predict it from
        if pos.shape[0]:
            yield i, a, b, pos
