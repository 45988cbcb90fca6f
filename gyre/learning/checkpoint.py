"""The core's checkpoints: weights an engine loads, and all a restarted core needs to go on.

`save(trainer, weights_dir, extra)` writes `weights_dir/v<k>/` (k = the trainer's policy
version) whole or not at all (into `.v<k>.partial/`, then renamed):
- `config.json`, `model.safetensors` (+ tokenizer files): an HF checkpoint (`Trainer.save`);
- `optimizer.safetensors`: AdamW's state per parameter name (`<name>/exp_avg`,
  `<name>/exp_avg_sq`, `<name>/step`) and torch's RNG state (`rng/torch`);
- `trainer_state.json`: `format`, `policy_version`, the optimizer's hyper-parameters, the
  learning-rate schedule's state (`lr_schedule`: gyre's schedule is constant, so its state
  is the rate and the optimizer steps taken), and the caller's `extra` (the core keeps the
  step's `step.completed` facts there, to publish them again after a restart).
`trainer_state.json` is written last, so a `v<k>/` holding it is complete; `latest` finds
the newest such directory and `restore` rebuilds a trainer from it (weights, optimizer
moments and step counts, learning rate, RNG state, policy version).

`next_epoch(weights_dir)` raises the core's epoch (DESIGN.md "Training exactly once") kept
beside the checkpoints in `weights_dir/core_epoch`, and returns it: 0 at the first start.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from gyre.learning.trainer import Trainer, TrainerConfig

FORMAT = "gyre.checkpoint.v1"
STATE = "trainer_state.json"
OPTIMIZER = "optimizer.safetensors"
_VERSION_DIR = re.compile(r"^v(\d+)$")


EPOCH = "core_epoch"


def next_epoch(weights_dir: Path) -> int:
    """Raise and return the core's epoch (0 the first time). Raises OSError, ValueError (a
    corrupt epoch file)."""
    weights_dir = Path(weights_dir)
    weights_dir.mkdir(parents=True, exist_ok=True)
    path = weights_dir / EPOCH
    epoch = int(path.read_text().strip()) + 1 if path.exists() else 0
    tmp = path.with_name(f".{EPOCH}.tmp")
    with open(tmp, "w") as f:
        f.write(f"{epoch}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return epoch


def path_of(weights_dir: Path, policy_version: int) -> Path:
    """`weights_dir/v<version>`."""
    return Path(weights_dir) / f"v{policy_version}"


def save(trainer: Trainer, weights_dir: Path, extra: dict | None = None) -> Path:
    """Write the checkpoint of `trainer.policy_version` (module docstring); returns its path.
    Blocking (run it in a worker thread). Raises OSError."""
    final = path_of(weights_dir, trainer.policy_version)
    partial = final.with_name(f".{final.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    trainer.save(partial)
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    tensors: dict[str, torch.Tensor] = {"rng/torch": torch.get_rng_state()}
    for p, state in trainer.optimizer.state.items():
        for key, value in state.items():
            tensors[f"{names[id(p)]}/{key}"] = torch.as_tensor(value).detach().cpu().contiguous()
    save_file(tensors, str(partial / OPTIMIZER))
    group = trainer.optimizer.param_groups[0]
    state = {
        "format": FORMAT,
        "policy_version": trainer.policy_version,
        "optimizer": {"name": "AdamW", "lr": group["lr"], "betas": list(group["betas"]), "eps": group["eps"],
                      "weight_decay": group["weight_decay"]},
        "lr_schedule": {"name": "constant", "lr": group["lr"], "optimizer_steps": _optimizer_steps(trainer)},
        "extra": extra or {},
    }
    with open(partial / STATE, "w") as f:
        json.dump(state, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(partial, final)
    return final


def _optimizer_steps(trainer: Trainer) -> int:
    steps = [int(s["step"]) for s in trainer.optimizer.state.values() if "step" in s]
    return max(steps, default=0)


def latest(weights_dir: Path) -> Path | None:
    """The newest complete checkpoint directory in `weights_dir` (None when there is none)."""
    best: tuple[int, Path] | None = None
    if not Path(weights_dir).is_dir():
        return None
    for child in Path(weights_dir).iterdir():
        m = _VERSION_DIR.match(child.name)
        if m and (child / STATE).is_file() and (best is None or int(m[1]) > best[0]):
            best = (int(m[1]), child)
    return best[1] if best else None


def read_state(path: Path) -> dict:
    """The checkpoint's `trainer_state.json`. Raises OSError, ValueError (not a gyre checkpoint)."""
    state = json.loads((Path(path) / STATE).read_text())
    if state.get("format") != FORMAT:
        raise ValueError(f"{path}: not a {FORMAT} checkpoint (format {state.get('format')!r})")
    return state


def restore(path: Path, cfg: TrainerConfig) -> tuple[Trainer, dict]:
    """A trainer as it was when `path` was saved, and its `trainer_state.json`. The learning
    rate comes from the checkpoint's schedule state. Blocking. Raises OSError, ValueError,
    KeyError (an optimizer tensor the model has no parameter for)."""
    state = read_state(path)
    trainer = Trainer(path, cfg, policy_version=int(state["policy_version"]))
    saved = load_file(str(Path(path) / OPTIMIZER))
    params = dict(trainer.model.named_parameters())
    per_param: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in saved.items():
        name, _, field = key.rpartition("/")
        if name == "rng":
            continue
        if name not in params:
            raise KeyError(f"{path}: optimizer state for unknown parameter {name!r}")
        per_param.setdefault(name, {})[field] = value
    for name, fields in per_param.items():
        p = params[name]
        trainer.optimizer.state[p] = {k: (v.to(p.device) if k != "step" else v) for k, v in fields.items()}
    for group in trainer.optimizer.param_groups:
        group["lr"] = float(state["lr_schedule"]["lr"])
    if "rng/torch" in saved:
        torch.set_rng_state(saved["rng/torch"])
    return trainer, state
