"""The core's trainer offloaded: its whole state on disk while the core cell does not train.

The core's trainer (the authoritative weights, the only AdamW state, and the gradient of the
step in flight) outlives its cell's switches (DESIGN.md "Training exactly once"), but a core
cell in rollout holds none of it (DESIGN.md "Cells and engines"). The weights and the AdamW
state of the trainer's version are its newest checkpoint already (the core checkpoints every
version before it publishes it, gyre.learning.checkpoint), so `offload(trainer, weights_dir)`
writes only what the checkpoint lacks: the gradient accumulated for the step in flight and the
step's metrics, to `weights_dir/core_step.safetensors` (tensors by parameter name; the
metadata holds `policy_version` and `metrics`, JSON), or removes that file when nothing is
accumulated. The caller then drops the trainer.

`restore(weights_dir, model_dir, cfg, version)` rebuilds it bit for bit: the checkpoint of
`version` (`model_dir`, the initial model, at version 0 when no checkpoint exists), then the
step's gradient and metrics. `clear(weights_dir)` drops a step file a previous core process
left (a restarted core trains the interrupted step again under a new epoch).
Blocking; callers run these in worker threads.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from gyre.learning import checkpoint
from gyre.learning.metrics import StepMetrics
from gyre.learning.trainer import Trainer, TrainerConfig

STEP_FILE = "core_step.safetensors"


def offload(trainer: Trainer, weights_dir: Path) -> int:
    """Write the step in flight of `trainer` (module docstring); returns the bytes written.
    Raises OSError (then nothing is lost: the caller keeps the trainer)."""
    from safetensors.numpy import save_file

    path = Path(weights_dir) / STEP_FILE
    grads = trainer.gradients()
    if not grads and not trainer.metrics.microsteps:
        path.unlink(missing_ok=True)
        return 0
    tmp = path.with_name(f".{STEP_FILE}.tmp")
    save_file(grads, str(tmp), metadata={"policy_version": str(trainer.policy_version),
                                          "metrics": json.dumps(trainer.metrics.to_dict())})
    os.replace(tmp, path)
    return sum(g.nbytes for g in grads.values())


def restore(weights_dir: Path, model_dir: Path, cfg: TrainerConfig, version: int) -> Trainer:
    """The trainer `offload` left at policy version `version` (module docstring). Raises
    RuntimeError when the checkpoint or step file on disk is of another version, OSError,
    ValueError."""
    from safetensors import safe_open

    weights_dir = Path(weights_dir)
    path = checkpoint.path_of(weights_dir, version)
    if (path / checkpoint.STATE).is_file():
        trainer, _ = checkpoint.restore(path, cfg)
    elif version == 0:
        trainer = Trainer(model_dir, cfg)
    else:
        raise RuntimeError(f"no checkpoint of policy version {version} in {weights_dir} to restore the core from")
    step = weights_dir / STEP_FILE
    if step.is_file():
        with safe_open(str(step), "np") as f:
            meta = f.metadata() or {}
            grads = {name: f.get_tensor(name) for name in f.keys()}
        if int(meta.get("policy_version", -1)) != version:
            raise RuntimeError(f"{step} holds a step of policy version {meta.get('policy_version')}, not {version}")
        trainer.add_gradients(grads)
        trainer.metrics = StepMetrics.from_dict(json.loads(meta["metrics"]))
    return trainer


def clear(weights_dir: Path) -> None:
    """Remove the step file (module docstring)."""
    (Path(weights_dir) / STEP_FILE).unlink(missing_ok=True)
