"""What the replica tests share: cells as real processes on a real nats-server, the test
playing the builder and the scheduler, and the one-replica reference they are held to.

- `Cells` starts `python -m handlers.cell` processes (`--recipe`, `--run`, the server in
  GYRE_NATS_URL) with a tiny float64 model, publishes micro-steps (object store plus
  `microstep.ready`), seals steps, switches cells, and follows every ledger and step fact.
- `reference(...)` trains the same micro-steps on one in-process trainer (float64).
- `check_weights` / `check_moments` hold the core's checkpoint to it (atol 1e-8).
"""
from __future__ import annotations

import asyncio
import collections
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

import schemas
from bus import Bus
from gyre.config import fields_of, load_recipe
from gyre.learning.settings import TrainerSettings
from gyre.trajectory.microstep import MicrostepData, Sample, pack, to_bytes
from gyre.trajectory.tree import Trajectory
from schemas import ids

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 256
FACTS = ("microstep.granted", "microstep.committed", "contribution.returned", "step.completed", "step.failed",
         "cell.switched", "weights.published", "weights.loaded")


def write_model(out: Path) -> Path:
    """A tiny Qwen3 (vocabulary 256) the cells train and serve."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, intermediate_size=64, max_position_embeddings=512,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(out)
    return out


def microsteps(step: int, n: int, seed: int) -> list[MicrostepData]:
    """n micro-steps of `step`, one execution each (so |E| = n): one to three trajectories of
    40-90 tokens sharing a 70-token prompt, every third token trained, behaviour log-probs
    off policy by a seeded amount, advantages of both signs."""
    rs = np.random.default_rng(seed)
    out = []
    for i in range(n):
        execution = f"s{step}-e{i}"
        prompt = rs.integers(0, VOCAB, 70)
        trajs = []
        for j in range(int(rs.integers(1, 4))):
            ids_ = np.concatenate([prompt, rs.integers(0, VOCAB, int(rs.integers(40, 90)))]).astype(np.int32)
            mask = np.zeros(ids_.shape[0], dtype=bool)
            mask[71::3] = True
            trajs.append(Trajectory(
                execution=execution, leaf=f"{execution}:{j}", role="main", input_ids=ids_, loss_mask=mask,
                behaviour_logprobs=np.where(mask, rs.uniform(-6.2, -4.9, ids_.shape[0]), 0).astype(np.float32),
                versions=np.where(mask, step, -1).astype(np.int32), temperatures=np.ones(ids_.shape[0], np.float32)))
        (ms,) = pack([Sample(execution, float(rs.choice([-1.0, -0.4, 0.7, 1.2])), tuple(trajs))], 10**6,
                     step=step, first_index=i)
        out.append(ms)
    return out


def recipe_text(model_dir: Path, transfer: str = "loopback", **train) -> str:
    settings = {**dict(lr=0.05, eps_low=0.2, eps_high=0.2, dtype="float64", lease_s=30.0, grant_budget=3,
                       device_time_s=0.0), **train}
    lines = "\n".join(f"{k} = {v!r}" if not isinstance(v, str) else f'{k} = "{v}"' for k, v in settings.items())
    return f'[run]\nname = "replicas"\nseed = 0\n\n[model]\ndir = "{model_dir}"\n\n[train]\n{lines}\n\n[cells]\ncount = 3\ntransfer = "{transfer}"\n'


def trainer_config(recipe_path: Path):
    from gyre.learning.trainer import TrainerConfig

    r = load_recipe(str(recipe_path))
    return TrainerConfig(**fields_of(r.train, TrainerSettings), seed=r.run.seed)


def reference(model_dir: Path, recipe_path: Path, steps: list[list[MicrostepData]]):
    """One trainer that runs every micro-step of every step, |E| = the step's micro-steps."""
    from gyre.learning.trainer import Trainer

    trainer = Trainer(model_dir, trainer_config(recipe_path))
    for mss in steps:
        for ms in mss:
            trainer.accumulate(ms)
        trainer.apply(len(mss))
    return trainer


def check_weights(checkpoint: Path, trainer) -> None:
    from safetensors.numpy import load_file

    saved = load_file(str(checkpoint / "model.safetensors"))
    want = trainer.weights()
    assert set(want) <= set(saved), sorted(set(want) - set(saved))
    for name, value in want.items():
        assert saved[name].dtype == np.float64, name
        np.testing.assert_allclose(saved[name], value, rtol=0, atol=1e-8, err_msg=name)


def check_moments(checkpoint: Path, trainer) -> None:
    """AdamW's moments in the checkpoint equal the reference's (and are not zeros)."""
    from safetensors.torch import load_file

    saved = load_file(str(checkpoint / "optimizer.safetensors"))
    for name, p in trainer.model.named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            want = trainer.optimizer.state[p][key]
            assert float(want.abs().sum()) > 0, (name, key)
            torch.testing.assert_close(saved[f"{name}/{key}"], want, rtol=0, atol=1e-8, msg=f"{name}/{key}")
        assert int(saved[f"{name}/step"]) == int(trainer.optimizer.state[p]["step"])


class Cells:
    """Cell processes of one run and the test's bus (module docstring)."""

    def __init__(self, server, run: str, tmp: Path, model_dir: Path, transfer: str = "loopback", **train) -> None:
        self.server = server
        self.run = run
        self.tmp = tmp
        self.model_dir = model_dir
        self.recipe = tmp / "recipe.toml"
        self.recipe.write_text(recipe_text(model_dir, transfer, **train))
        self.runs = tmp / "runs"
        self.run_dir = self.runs / run
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}
        self.starts: collections.Counter[str] = collections.Counter()
        self.facts: dict[str, list] = collections.defaultdict(list)
        self.switch_seq: collections.Counter[str] = collections.Counter()
        self.roles: dict[str, str] = {}
        self.bus: Bus | None = None
        self._stop = asyncio.Event()
        self._follower: asyncio.Task | None = None

    # -- processes ---------------------------------------------------------------------------------
    def start(self, cell: str) -> None:
        env = dict(os.environ, GYRE_NATS_URL=self.server.url, GYRE_NATS_TOKEN=self.server.token,
                   GYRE_RUNS_DIR=str(self.runs), HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1",
                   GYRE_ENGINE_TOKEN="replicas-test-engine-token")
        self.starts[cell] += 1
        log = open(self.run_dir / "logs" / f"{cell}.{self.starts[cell]}.log", "ab")
        self.procs[cell] = subprocess.Popen(
            [sys.executable, "-m", "handlers.cell", "--recipe", str(self.recipe), "--run", self.run, "--cell", cell,
             "--log-json"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
        self.roles.pop(cell, None)

    def signal(self, cell: str, sig: int) -> None:
        self.procs[cell].send_signal(sig)
        if sig == signal.SIGKILL:
            self.procs[cell].wait(10)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}"
                         for p in sorted((self.run_dir / "logs").glob("*.log")))

    async def __aenter__(self) -> Cells:
        self.bus = await Bus.connect(self.server.url, token=self.server.token, run=self.run, name="test")
        await self.bus.ensure_streams()
        self._follower = asyncio.create_task(self.bus.replay(list(FACTS), self._on_fact, stop=self._stop))
        return self

    async def __aexit__(self, *exc) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._stop.set()
        if self._follower is not None:
            await asyncio.wait([self._follower], timeout=10)
        if self.bus is not None:
            await self.bus.close()

    async def _on_fact(self, event) -> None:
        self.facts[event.NAME].append(event)
        if isinstance(event, schemas.CellSwitched):
            self.roles[event.cell] = event.to_role

    async def until(self, predicate, what: str, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            dead = {c: p.returncode for c, p in self.procs.items() if p.poll() is not None and p.returncode != -9}
            if dead:
                raise AssertionError(f"cells exited {dead} while waiting for {what}\n{self.logs()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s}s waiting for {what}\n{self.logs()}")
            await asyncio.sleep(0.05)

    # -- the builder's and the scheduler's part ------------------------------------------------
    async def publish(self, mss: list[MicrostepData]) -> None:
        for ms in mss:
            key = f"step-{ms.step}/mstep-{ms.index}"
            await self.bus.put_object(key, to_bytes(ms))
            await self.bus.publish(schemas.MicrostepReady(
                event_id=ids.microstep(self.run, ms.step, ms.index), step=ms.step, microstep=ms.index, key=key,
                executions=tuple(schemas.MicrostepExecution(execution=e, n_tokens=n, advantage=a)
                                 for e, n, a in ms.execution_summary()),
                tokens=ms.n_tokens, trained=ms.n_trained, trajectories=ms.n_trajectories))

    async def seal(self, step: int, microsteps: int) -> None:
        await self.bus.publish(schemas.StepSealed(event_id=ids.sealed(self.run, step), step=step,
                                                  microsteps=microsteps, executions=microsteps, groups=1))

    async def switch(self, cell: str, to_role: str) -> None:
        await self.until(lambda: cell in self.roles, f"{cell} to announce itself")
        from_role = self.roles[cell]
        seq = self.switch_seq[cell]
        self.switch_seq[cell] += 1
        await self.bus.publish(schemas.CellSwitch(event_id=ids.switch(self.run, cell, seq), cell=cell, seq=seq,
                                                  from_role=from_role, to_role=to_role, reason="test"))
        await self.until(lambda: self.roles.get(cell) == to_role, f"{cell} to switch to {to_role}")

    # -- reading the facts ------------------------------------------------------------------------------
    def of(self, name: str, step: int | None = None, **match) -> list:
        return [e for e in self.facts[name] if (step is None or e.step == step)
                and all(getattr(e, k) == v for k, v in match.items())]

    def completed(self, step: int) -> schemas.StepCompleted | None:
        done = self.of("step.completed", step)
        return done[-1] if done else None

    def uncommitted(self, cell: str, step: int) -> set[int]:
        """Ids of `step` granted to `cell` under the newest epoch and not committed yet."""
        granted = self.of("microstep.granted", step, replica=cell)
        if not granted:
            return set()
        epoch = max(g.epoch for g in granted)
        committed = {c.microstep for c in self.of("microstep.committed", step, epoch=epoch)}
        return {g.microstep for g in granted if g.epoch == epoch} - committed

    def commits(self, step: int, epoch: int) -> collections.Counter:
        """micro-step id → how many commits it got under `epoch`."""
        return collections.Counter(c.microstep for c in self.of("microstep.committed", step, epoch=epoch))

    async def settled_commits(self, step: int, epoch: int, n: int) -> collections.Counter:
        """`commits` once all n ids are seen (the streams are followed concurrently, so a step's
        `step.completed` may be read before its last `microstep.committed`)."""
        await self.until(lambda: set(self.commits(step, epoch)) >= set(range(n)),
                         f"the commits of step {step} (epoch {epoch})")
        await asyncio.sleep(0.2)  # and anything that might follow them
        return self.commits(step, epoch)

    def checkpoint(self, version: int) -> Path:
        return self.run_dir / "weights" / f"v{version}"
