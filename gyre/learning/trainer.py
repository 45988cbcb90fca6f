"""Streaming GSPO trainer on torch: accumulate micro-steps, then one optimizer step.

Contract:
- `Trainer(model_dir, cfg)` loads an HF causal LM from a local directory (float32, train
  mode) with AdamW. `policy_version` is the version of its current weights.
- `accumulate(ms)` runs forward-backward on one micro-step and adds the gradient of the
  micro-step's *summed* GSPO loss (`gyre.learning.gspo`); the weights do not change, so every
  micro-step of a step sees the same policy. Each trajectory's sequence is cut after its
  last loss position, and the output head runs only at the positions that predict a
  trained token (hidden state at t − 1), in chunks whose logits are recomputed in
  backward, so the 151,936-wide head never materialises for the whole sequence.
- Shared prefixes (DESIGN.md "Trajectory processing": several kept trajectories of one
  execution share e.g. a system prompt): the micro-step's cut sequences form a trie
  (`prefix_forest`); a common prefix of ≥ `shared_prefix_min_tokens` tokens is run once
  with a KV cache, and each branch continues from a copy of that cache with positions
  counting on from the prefix length. A prefix position that carries loss for several
  trajectories still gets one head row per trajectory (each trajectory's K_τ is its own),
  so the loss is unchanged; the gradient of a trie group is the sum of its trajectories'
  gradients, taken in one backward pass. Trajectories sharing nothing long enough run from
  position 0, the short ones right-padded into batches (`lone_batch_positions`: one
  forward, one head call and one backward per batch, so one dense (V, H) gradient rather
  than one per trajectory), a long one on its own. A trie group or batch holds its
  whole autograd graph until its backward: at most the group's distinct positions, which
  the micro-step's token budget bounds. Attention of a branch over its cached prefix is
  computed without a (q, kv) mask: on CPU as two flash-attention blocks (prefix: full,
  branch: causal) merged by log-sum-exp (the backward of each block is the flash backward
  with the merged output and log-sum-exp, as in blockwise/ring attention, Liu et al. 2023,
  arXiv:2310.01889); elsewhere with SDPA and a lower-right causal bias.
- `apply(num_executions)` divides the accumulated gradients by |E| (DESIGN.md "Learning":
  L = (1/|E|) Σ_e ...), clips the global norm, steps AdamW, zeroes gradients and increments
  `policy_version`.
- Replicas (DESIGN.md "Training exactly once"): `gradients()` is the accumulated gradient
  sum by parameter name (what a satellite returns), `add_gradients(grads, metrics)` adds
  another replica's sum and metrics into this one (the core), `discard()` drops what was
  accumulated (a refused or void contribution). `weights()` / `load_weights(tensors,
  version)` read and replace the parameters (a satellite loads the core's snapshot). The
  step's metrics (`gyre.learning.metrics.StepMetrics`) accumulate in `metrics` beside the
  gradient; the replica's name labels its micro-steps there (`replica`).
- `cfg.dtype` is the parameters' and gradients' dtype (float64 for exactness checks).
- `save(out_dir)` writes an HF checkpoint (config.json + model.safetensors, tokenizer files
  copied from the source directory) that an engine can load.

Gradients with and without sharing agree to float tolerance (summation order differs).

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

from gyre.learning.gspo import gspo_loss
from gyre.learning.metrics import StepMetrics, staleness_of
from gyre.learning.prefix import (  # noqa: F401 - PrefixNode, prefix_forest, _CachedPrefixAttention: re-exported
    PrefixNode, _CachedPrefixAttention, branch_cache, enable_prefix_attention, prefix_forest,
)
from gyre.learning.settings import TrainerSettings
from gyre.serving.model import weights_readable_as_config
from gyre.trajectory.microstep import SHARED_PREFIX_MIN_TOKENS, MicrostepData

log = structlog.get_logger()

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TrainerConfig(TrainerSettings):
    """Configuration of a trainer replica: the recipe's settings (`TrainerSettings`: lr,
    weight_decay, grad_clip, eps_low, eps_high) and those no recipe sets."""

    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW moment coefficients, each in [0, 1)."""
    behaviour_logprobs: Literal["proxy", "recompute"] = "proxy"
    """π_old of the GSPO ratio: `proxy` = the log-probs the proxy recorded; `recompute` = the
    trainer's own log-probs under the step's (fixed) weights."""
    head_chunk_tokens: int = 512
    """Loss positions per output-head chunk (bounds the (K, V) logits), >= 1."""
    shared_prefix_min_tokens: int = SHARED_PREFIX_MIN_TOKENS
    """A token prefix common to several trajectories of a micro-step is run once when it is at
    least this long, in tokens; 0 = never (every trajectory on its own)."""
    lone_batch_positions: int = 2048
    """Lone trajectories (no prefix shared with another) cut at no more than half this many
    positions run together, right-padded, in batches of at most this many padded positions:
    one forward and one dense head and embedding gradient per batch rather than per
    trajectory (on a 151,936-token vocabulary that gradient is most of a short trajectory's
    cost); 0 = each on its own."""
    device: str = "cpu"
    """torch device string."""
    replica: str = "trainer"
    """The name this replica's micro-steps carry in the step's metrics (the cell id)."""
    seed: int = 0
    """torch seed set at construction (the recipe's `run.seed`)."""

    def __post_init__(self) -> None:
        TrainerSettings.__post_init__(self)  # explicit: zero-argument super() fails in a slotted dataclass
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"TrainerConfig.betas must be in [0, 1), got {self.betas}")
        if self.behaviour_logprobs not in ("proxy", "recompute"):
            raise ValueError(f"TrainerConfig.behaviour_logprobs must be 'proxy' or 'recompute', got {self.behaviour_logprobs!r}")
        if self.head_chunk_tokens < 1:
            raise ValueError(f"TrainerConfig.head_chunk_tokens must be >= 1, got {self.head_chunk_tokens}")
        if self.shared_prefix_min_tokens < 0:
            raise ValueError(f"TrainerConfig.shared_prefix_min_tokens must be >= 0, got {self.shared_prefix_min_tokens}")


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
    metrics: dict = dataclasses.field(default_factory=dict)
    """`StepMetrics.summary(|E|)` of the step: ratio and KL statistics, staleness, replicas, phases."""


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
        self.dtype = getattr(torch, cfg.dtype)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, local_files_only=True, dtype=self.dtype)
        self.model.to(self.device)
        self.model.train()
        if self.dtype == torch.float64:
            _full_precision_norms(self.model)
        self._decoder = getattr(self.model, self.model.base_model_prefix)
        self._head = self.model.get_output_embeddings()
        self._share_min = cfg.shared_prefix_min_tokens
        if self._share_min and not enable_prefix_attention(self.model):
            log.warning("trainer.shared_prefix.disabled", reason="model attention is not plain full-attention SDPA",
                        attn_implementation=self.model.config._attn_implementation)
            self._share_min = 0
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.adam_eps, weight_decay=cfg.weight_decay,
        )
        self._reset_step()

    def _reset_step(self) -> None:
        self.metrics = StepMetrics()

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

    def _tree_logprobs(self, root: PrefixNode, ids: torch.Tensor, temps: torch.Tensor,
                       trajs: list[tuple[int, int, int, np.ndarray]]) -> list[torch.Tensor]:
        """(K_r,) log-probs of every trajectory r of a trie group, in `root.rows` order.

        ids, temps: the micro-step's (T,) tensors; trajs[r] = (trajectory, start, end, pos).
        Each node runs its segment once on a copy of its parent's KV cache; its head rows are
        the loss positions of each of its rows inside the segment.
        """
        pieces: dict[int, list[torch.Tensor]] = {r: [] for r in root.rows}
        stack: list[tuple[PrefixNode, list | None]] = [(root, None)]
        while stack:
            node, past = stack.pop()
            if node.end == node.start:
                continue  # a trajectory that ends where its parent does: all its rows are above
            _, a, _, _ = trajs[node.rows[0]]
            inputs = ids[a + node.start:a + node.end].unsqueeze(0)
            positions = torch.arange(node.start, node.end, device=self.device).unsqueeze(0)
            cache = branch_cache(past)
            keep = bool(node.children)
            out = self._decoder(input_ids=inputs, position_ids=positions, cache=cache, use_cache=keep)
            hidden = out.last_hidden_state[0]  # (end − start, H)
            rows, targets, tmp, counts = [], [], [], []
            for r in node.rows:
                _, a, _, pos = trajs[r]
                lo, hi = np.searchsorted(pos, node.start + 1), np.searchsorted(pos, node.end, side="right")
                p = torch.as_tensor(pos[lo:hi], device=self.device)
                rows.append(p - 1 - node.start)
                targets.append(ids.index_select(0, a + p))
                tmp.append(temps.index_select(0, a + p))
                counts.append(hi - lo)
            if sum(counts):
                lp = head_logprobs(self._head, hidden.index_select(0, torch.cat(rows)), torch.cat(targets),
                                   torch.cat(tmp), self.cfg.head_chunk_tokens)
                for r, chunk in zip(node.rows, lp.split(counts)):
                    pieces[r].append(chunk)
            if keep:
                kv = [(layer.keys, layer.values) for layer in out.cache.layers]
                stack.extend((child, kv) for child in reversed(node.children))  # DFS: parents before children
        return [torch.cat(pieces[r]) for r in root.rows]

    def _groups(self, ms: MicrostepData) -> tuple[list[tuple[int, int, int, np.ndarray]], list[PrefixNode]]:
        """(trajs, groups): trajs = [(trajectory, start, end, pos)] with ≥ 1 loss position; groups
        = the trie roots over their cut sequences (`prefix_forest`); a lone trajectory is a
        root without children."""
        trajs = list(_loss_positions(ms))
        if self._share_min == 0 or len(trajs) < 2:
            return trajs, [PrefixNode(0, int(t[3][-1]), [r]) for r, t in enumerate(trajs)]
        return trajs, prefix_forest([ms.input_ids[a:a + int(pos[-1])] for _, a, _, pos in trajs], self._share_min)

    def _group_logprobs(self, ids: torch.Tensor, temps_all: torch.Tensor, trajs, root: PrefixNode) -> list[torch.Tensor]:
        """(K_r,) log-probs of each trajectory of `root.rows`, in that order."""
        if not root.children:  # a lone trajectory, from position 0
            _, a, b, pos_np = trajs[root.rows[0]]
            pos = torch.as_tensor(pos_np, device=self.device)
            return [self._trajectory_logprobs(ids[a:b], pos, temps_all[a:b][pos])]
        return self._tree_logprobs(root, ids, temps_all, trajs)

    def _lone_batches(self, trajs, groups: list[PrefixNode]) -> list[PrefixNode]:
        """The micro-step's trie groups with its short lone trajectories (no shared prefix, cut
        at ≤ `lone_batch_positions` / 2 positions) gathered into batch groups: a `PrefixNode`
        without children whose `rows` are several trajectories, its `end` the longest cut, at
        most `lone_batch_positions` padded positions each. Others stay as they are, in order."""
        budget = self.cfg.lone_batch_positions
        out: list[PrefixNode] = []
        batch: list[int] = []
        width = 0

        def flush() -> None:
            if batch:
                out.append(PrefixNode(0, width, list(batch)))
                batch.clear()

        for root in groups:
            cut = int(trajs[root.rows[0]][3][-1])
            if root.children or budget <= 0 or 2 * cut > budget:
                out.append(root)
                continue
            if batch and (len(batch) + 1) * max(width, cut) > budget:
                flush()
                width = 0
            batch.append(root.rows[0])
            width = max(width, cut)
        flush()
        return out

    def _batch_logprobs(self, ids: torch.Tensor, temps_all: torch.Tensor, trajs, root: PrefixNode) -> list[torch.Tensor]:
        """(K_r,) log-probs of each lone trajectory of a batch group (`_lone_batches`), in
        `root.rows` order: one decoder forward over the right-padded cut sequences (causal
        attention, so a real position never sees the padding) and one head call for all
        their loss positions, so the backward forms one dense embedding and head gradient
        for the batch instead of one per trajectory."""
        if len(root.rows) == 1:
            return self._group_logprobs(ids, temps_all, trajs, root)
        members = [trajs[r] for r in root.rows]
        width = max(int(pos[-1]) for _, _, _, pos in members)
        inputs = torch.zeros((len(members), width), dtype=torch.long, device=self.device)
        rows, cols, targets, temps, counts = [], [], [], [], []
        for j, (_, a, _, pos_np) in enumerate(members):
            cut = int(pos_np[-1])
            inputs[j, :cut] = ids[a:a + cut]
            pos = torch.as_tensor(pos_np, device=self.device)
            rows.append(torch.full_like(pos, j))
            cols.append(pos - 1)
            targets.append(ids.index_select(0, a + pos))
            temps.append(temps_all.index_select(0, a + pos))
            counts.append(int(pos.shape[0]))
        positions = torch.arange(width, device=self.device).expand(len(members), width)
        hidden = self._decoder(input_ids=inputs, position_ids=positions, use_cache=False).last_hidden_state  # (B, W, H)
        h = hidden[torch.cat(rows), torch.cat(cols)]  # (K, H)
        lp = head_logprobs(self._head, h, torch.cat(targets), torch.cat(temps), self.cfg.head_chunk_tokens)
        return list(lp.split(counts))

    @torch.no_grad()
    def logprobs(self, ms: MicrostepData) -> np.ndarray:
        """(T,) float32 log-probs of the current weights at `ms`'s loss positions, 0 elsewhere."""
        out = np.zeros(ms.n_tokens, dtype=np.float32)
        ids = torch.as_tensor(ms.input_ids, dtype=torch.long, device=self.device)
        temps_all = torch.as_tensor(ms.temperatures, dtype=torch.float32, device=self.device)
        trajs, groups = self._groups(ms)
        for root in self._lone_batches(trajs, groups):
            members = [trajs[r] for r in root.rows]
            for (_, a, _, pos), lp in zip(members, self._batch_logprobs(ids, temps_all, trajs, root)):
                out[a + pos] = lp.float().cpu().numpy()
        return out

    # -- training ---------------------------------------------------------------------
    def accumulate(self, ms: MicrostepData) -> dict[str, float]:
        """Forward-backward on one micro-step; gradients add up until `apply`.

        Returns stats: `loss_sum` (this micro-step's summed loss, before 1/|E|), `tokens`,
        `trajectories`, `clipped`, `ratio_mean`, `ratio_min`, `ratio_max`, `ratio_sum`,
        `ratio_sq_sum`, `kl_sum` (gyre.learning.gspo), `positions` (decoder positions run) and
        `shared_positions` (positions a shared prefix saved); they are also folded into `metrics`.
        """
        ids = torch.as_tensor(ms.input_ids, dtype=torch.long, device=self.device)
        temps_all = torch.as_tensor(ms.temperatures, dtype=torch.float32, device=self.device)
        behaviour_all = torch.as_tensor(ms.behaviour_logprobs, dtype=torch.float32, device=self.device)
        adv = torch.as_tensor(ms.advantages, dtype=torch.float32, device=self.device)
        n_e = torch.as_tensor(ms.n_e, dtype=torch.float32, device=self.device)
        loss_sum, tokens, trajs_n, clipped, positions, shared = 0.0, 0.0, 0.0, 0.0, 0, 0
        ratio_sum, ratio_sq_sum, kl_sum = 0.0, 0.0, 0.0
        ratios: list[float] = []
        rmin, rmax = math.inf, -math.inf
        trajs, groups = self._groups(ms)
        for root in self._lone_batches(trajs, groups):
            members = [trajs[r] for r in root.rows]
            cut = sum(int(pos[-1]) for _, _, _, pos in members)
            run = root.positions() if root.children or len(root.rows) == 1 else cut
            positions, shared = positions + run, shared + cut - run
            total = None
            for (i, a, b, pos_np), logp in zip(members, self._batch_logprobs(ids, temps_all, trajs, root)):
                pos = torch.as_tensor(pos_np, device=self.device)
                behaviour = logp.detach() if self.cfg.behaviour_logprobs == "recompute" else behaviour_all[a:b][pos]
                k = logp.shape[0]
                loss, st = gspo_loss(
                    logp, behaviour, torch.ones(k, dtype=torch.bool, device=self.device),
                    torch.zeros(k, dtype=torch.long, device=self.device), adv[i:i + 1], n_e[i:i + 1],
                    eps_low=self.cfg.eps_low, eps_high=self.cfg.eps_high,
                )
                if float(adv[i]) != 0.0 and st["clipped"] < st["tokens"]:
                    total = loss if total is None else total + loss  # otherwise the gradient is exactly zero
                loss_sum += float(loss.detach())
                tokens += st["tokens"]
                trajs_n += st["trajectories"]
                clipped += st["clipped"]
                ratio_sum, ratio_sq_sum, kl_sum = ratio_sum + st["ratio_sum"], ratio_sq_sum + st["ratio_sq_sum"], kl_sum + st["kl_sum"]
                ratios.append(st["ratio_mean"])
                rmin, rmax = min(rmin, st["ratio_min"]), max(rmax, st["ratio_max"])
            if total is not None:
                total.backward()  # one pass per group: a shared prefix's backward runs once
        stats = {
            "loss_sum": loss_sum, "tokens": tokens, "trajectories": trajs_n, "clipped": clipped,
            "ratio_mean": float(np.mean(ratios)) if ratios else 1.0,
            "ratio_min": rmin if ratios else 1.0, "ratio_max": rmax if ratios else 1.0,
            "ratio_sum": ratio_sum, "ratio_sq_sum": ratio_sq_sum, "kl_sum": kl_sum,
            "positions": float(positions), "shared_positions": float(shared),
        }
        self.metrics.add_microstep(stats, staleness_of(ms.step, ms.versions, ms.loss_mask), self.cfg.replica)
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
        m = self.metrics
        stats = StepStats(
            loss=m.loss_sum / num_executions, grad_norm=grad_norm, tokens=m.tokens,
            trajectories=m.trajectories, microsteps=m.microsteps, executions=num_executions,
            clipped_fraction=m.clipped / m.tokens if m.tokens else 0.0,
            policy_version=self.policy_version, skipped=skipped, metrics=m.summary(num_executions),
        )
        self._reset_step()
        log.info("trainer.step.applied", **{k: v for k, v in dataclasses.asdict(stats).items() if k != "metrics"})
        return stats

    # -- replicas ---------------------------------------------------------------------
    def gradients(self) -> dict[str, np.ndarray]:
        """The accumulated gradient sum (before 1/|E|) by parameter name, as CPU numpy
        copies; parameters without a gradient are left out (their gradient is zero)."""
        return {name: p.grad.detach().cpu().numpy().copy() for name, p in self.model.named_parameters()
                if p.grad is not None}

    def add_gradients(self, grads: dict[str, np.ndarray], metrics: StepMetrics | None = None) -> None:
        """Add another replica's gradient sum (`gradients()` of a replica on the same weights)
        and its metrics. Raises ValueError for an unknown name or a shape that differs; then
        nothing was added."""
        params = dict(self.model.named_parameters())
        for name, g in grads.items():
            p = params.get(name)
            if p is None or tuple(g.shape) != tuple(p.shape):
                raise ValueError(f"gradient {name!r} {tuple(g.shape)} does not fit the model"
                                 + ("" if p is None else f" ({tuple(p.shape)})"))
        for name, g in grads.items():
            p = params[name]
            t = torch.as_tensor(g, device=self.device).to(p.dtype)
            if p.grad is None:
                p.grad = t.clone()
            else:
                p.grad.add_(t)
        if metrics is not None:
            self.metrics.merge(metrics)

    def discard(self) -> None:
        """Drop the accumulated gradient and metrics (the weights and optimizer stay)."""
        self.optimizer.zero_grad(set_to_none=True)
        self._reset_step()

    def weights(self) -> dict[str, np.ndarray]:
        """The parameters by name, as CPU numpy copies (a snapshot of `policy_version`)."""
        return {name: p.detach().cpu().numpy().copy() for name, p in self.model.named_parameters()}

    @torch.no_grad()
    def load_weights(self, tensors: dict[str, np.ndarray], policy_version: int) -> None:
        """Replace every parameter with `tensors` (`weights()` of another replica) and drop any
        accumulated step. Raises ValueError, changing nothing, when a name is missing or
        unknown or a shape differs."""
        params = dict(self.model.named_parameters())
        if set(tensors) != set(params):
            raise ValueError(f"snapshot names differ from the model's: missing {sorted(set(params) - set(tensors))[:5]}, "
                             f"unknown {sorted(set(tensors) - set(params))[:5]}")
        for name, p in params.items():
            if tuple(tensors[name].shape) != tuple(p.shape):
                raise ValueError(f"snapshot tensor {name!r} {tuple(tensors[name].shape)} != model's {tuple(p.shape)}")
        for name, p in params.items():
            p.copy_(torch.as_tensor(tensors[name]))
        self.policy_version = policy_version
        self.discard()

    # -- weights ----------------------------------------------------------------------
    def save(self, out_dir: str | Path) -> Path:
        """Write config.json + model.safetensors (+ tokenizer files of the source) to out_dir."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(out, safe_serialization=True)
        weights_readable_as_config(out)
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


def _full_precision_norms(model) -> int:
    """Make every RMSNorm of `model` compute in its input's dtype; returns how many.

    transformers' RMSNorms (Qwen3RMSNorm and kin) cast to float32 and back, so a float64
    model is rounded to float32 precision at every norm, and two summation orders that agree
    to 1e-16 before a norm can differ by 1e-7 after it. A float64 trainer exists to compare
    replicas and partitions to 1e-8, so its norms stay in float64.
    """
    import types

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    n = 0
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(forward, module)
            n += 1
    return n


def _loss_positions(ms: MicrostepData):
    """Yield (trajectory, start, end, pos) per trajectory with ≥ 1 loss position; pos (K,) int64 local, ≥ 1."""
    cu = ms.cu_seqlens
    for i in range(ms.n_trajectories):
        a, b = int(cu[i]), int(cu[i + 1])
        pos = np.flatnonzero(ms.loss_mask[a:b])
        pos = pos[pos >= 1]  # position 0 has no context to predict it from
        if pos.shape[0]:
            yield i, a, b, pos
