"""`gyre run RECIPE`: one training run on this machine, every daemon as a process.

Creates `runs/<run id>/` (config.json, key_secret, engine_token and nats.json readable
only by the owner, logs/, metrics.jsonl, summary.json), starts a private nats-server (unless
`GYRE_NATS_URL` names an external one), writes the model if the recipe has none,
starts proxy, runner, evaluator, builder, cells and scheduler, follows the run's
events to show progress, and stops everything once the last step is completed.
`gyre run --resume RUN_DIR` starts a run again after all its processes died, reusing its
directory (handlers.resume says what it recovers).
Exit status: 0 done, 1 a daemon failed or the run timed out, 2 bad arguments.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import os
import secrets
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import orjson

import schemas
from bus import Bus, BusError, ConnectError
from bus.server import NatsServer
from bus.subjects import check_run
from gyre.config import Recipe, RecipeError, load_recipe
from handlers.daemon import stop_processes
from handlers.run_cells import switches
from handlers.run_summary import print_summary as _print_summary

DAEMONS = ("proxy", "runner", "evaluator", "builder")
RETURN_WAIT_S = 30.0  # a done run's wait for its training cells' return to rollout before it stops them


def runs_root() -> Path:
    return Path(os.environ.get("GYRE_RUNS_DIR", "runs")).resolve()


def live_run(run_dir: str | None, run: str | None, ended_hint: str = "") -> tuple[dict, Path]:
    """(nats.json, the run directory resolved) of `run_dir`, or of runs/`run` (default
    runs/latest), whose `gyre run` is still alive. Resolved once: a new run repoints
    runs/latest. RuntimeError saying how the run ended (and `ended_hint`) otherwise."""
    from handlers.daemon import ended_run_message, read_nats_info, run_owner_alive

    path = (Path(run_dir) if run_dir else runs_root() / (run or "latest")).resolve()
    info = read_nats_info(path)
    if not run_owner_alive(info):
        raise RuntimeError(ended_run_message(path, info) + ended_hint.format(run_dir=path))
    return info, path


def _parse_overrides(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise RecipeError(f"--set {item!r}: expected table.key=value")
        try:
            out[key.strip()] = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            out[key.strip()] = raw  # a bare string
    return out


def _write_private(path: Path, data: bytes) -> None:
    """Write `path` (mode 0600) whole or not at all: readers poll for these files
    (`runs/latest/nats.json`), so a half-written one must never be seen."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


class Progress:
    """Follows the run's events: prints progress lines, appends metrics, builds the summary."""

    def __init__(self, recipe: Recipe, metrics_path: Path, tensorboard_dir: Path | None = None,
                 resumed: bool = False) -> None:
        """resumed: `metrics_path` holds the lines of the run before it was resumed; the events
        behind them come back in the replay and are not written again (`handlers.resume.written`),
        and `t` goes on from the last line's."""
        from handlers.resume import written

        self.recipe = recipe
        self._written, last_t = written(metrics_path) if resumed else ({}, 0.0)
        self.metrics = open(metrics_path, "ab")
        self.tensorboard_dir = tensorboard_dir
        self._writer = None  # TensorBoard's SummaryWriter, made at the first step
        self.t0 = time.monotonic() - last_t
        self.started: set[str] = set()
        self.finished: dict[str, str] = {}
        self.rewards: dict[int, dict[str, float]] = {}
        self.excluded: set[str] = set()
        self.calls = 0
        self.calling: set[str] = set()  # executions with at least one recorded call
        self.calls_by_status: dict[str, int] = {}  # ok, error (refused or failed), aborted
        self.exit_nonzero: set[str] = set()  # harnesses that exited with a non-zero code
        self.calls_by_version: dict[int, int] = {}
        self.tokens_generated = 0
        self.completed: dict[int, schemas.StepCompleted] = {}
        self.sealed: dict[int, schemas.StepSealed] = {}
        self.switches: list[dict] = []
        self.failed: schemas.StepFailed | None = None
        self.done = asyncio.Event()

    def _emit(self, kind: str, **fields) -> bool:
        """Append a metrics line; False when a resumed run's earlier process wrote it already."""
        if self._written:
            from handlers.resume import line_key

            key = line_key({"kind": kind, **fields})
            if self._written.get(key, 0) > 0:
                self._written[key] -= 1
                return False
        fields = {"t": round(time.monotonic() - self.t0, 3), "kind": kind, **fields}
        self.metrics.write(orjson.dumps(fields) + b"\n")
        self.metrics.flush()
        return True

    def _scalars(self, step: int, values: dict[str, float]) -> None:
        """TensorBoard scalars of `step` (tags `train/<name>`) in `tensorboard_dir`."""
        if self.tensorboard_dir is None:
            return
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter
            self._writer = SummaryWriter(str(self.tensorboard_dir))
        for name, value in values.items():
            if value is not None:
                self._writer.add_scalar(f"train/{name}", value, step)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self.metrics.close()

    def _say(self, text: str) -> None:
        print(f"[{time.monotonic() - self.t0:7.1f}s] {text}", flush=True)

    async def on_event(self, event) -> None:
        steps = self.recipe.run.steps
        per_step = self.recipe.tasks.groups_per_step * self.recipe.tasks.group_size
        if isinstance(event, schemas.RouteUpdated):  # dispatches (a work queue, so not replayed itself)
            for route in event.routes:
                if route.reason == "dispatch":
                    self._emit(schemas.ExecutionDispatched.NAME, execution=route.execution, cell=route.cell)
        elif isinstance(event, schemas.ExecutionStarted):
            self.started.add(event.info.execution)
        elif isinstance(event, schemas.ExecutionFinished):
            self.finished[event.info.execution] = event.status
            if event.exit_code:
                self.exit_nonzero.add(event.info.execution)
            step = event.info.step
            done = sum(1 for e in self.finished if e.startswith(f"s{step}-"))
            self._emit(schemas.ExecutionFinished.NAME, execution=event.info.execution, status=event.status,
                       duration_s=event.duration_s)
            running = len(self.started - self.finished.keys())
            self._say(f"step {step}: execution {event.info.execution} {event.status} "
                      f"({event.duration_s:.1f}s) — {done}/{per_step} done, {running} running")
        elif isinstance(event, schemas.ExecutionScored):
            step = event.info.step
            if event.outcome == "excluded":
                self.excluded.add(event.info.execution)
            else:
                self.rewards.setdefault(step, {})[event.info.execution] = float(event.reward or 0.0)
            self._emit(schemas.ExecutionScored.NAME, execution=event.info.execution, outcome=event.outcome,
                       reward=event.reward, reason=event.reason)
        elif isinstance(event, schemas.CallCompleted):
            self.calls += 1
            self.calling.add(event.execution)
            self.calls_by_status[event.status] = self.calls_by_status.get(event.status, 0) + 1
            for _s, _e, v in event.versions:
                self.calls_by_version[v] = self.calls_by_version.get(v, 0) + 1
            from handlers.metrics import completion_tokens
            tokens = completion_tokens(event)
            self.tokens_generated += tokens
            self._emit(schemas.CallCompleted.NAME, call=event.call, api=event.api, status=event.status,
                       cell=event.cell, total_s=event.timings.get("total_s"), completion_tokens=tokens)
        elif isinstance(event, schemas.StepSealed):
            self.sealed[event.step] = event
            self._say(f"step {event.step}: sealed — {event.microsteps} micro-steps, {event.executions} executions, "
                      f"reward mean {event.reward_mean:.3f}, zero-variance groups {event.zero_variance_groups}")
        elif isinstance(event, schemas.CellSwitched):
            self.switches.append({"cell": event.cell, "from": event.from_role, "to": event.to_role, "step": len(self.completed),
                                  "t": round(time.monotonic() - self.t0, 3), **event.durations})
            # `bytes` (what the switch freed and pulled) where the cell measures it
            self._emit(schemas.CellSwitched.NAME, cell=event.cell, from_role=event.from_role, to_role=event.to_role,
                       durations=event.durations, **({"bytes": event.bytes} if getattr(event, "bytes", None) else {}))
            if event.seq >= 0 or event.from_role != "idle":
                self._say(f"{event.cell} → {event.to_role} ({event.durations.get('total_s', 0.0):.2f}s)")
        elif isinstance(event, schemas.StepCompleted):
            if event.step in self.completed:
                return
            self.completed[event.step] = event
            scores = list(self.rewards.get(event.step, {}).values())
            reward_mean = sum(scores) / len(scores) if scores else None
            reward_std = (sum((r - reward_mean) ** 2 for r in scores) / len(scores)) ** 0.5 if scores else None
            hist = {int(k): int(v) for k, v in event.staleness_histogram.items()}
            fresh = self._emit(schemas.StepCompleted.NAME, step=event.step, loss=event.loss, grad_norm=event.grad_norm,
                       reward_mean=reward_mean, reward_std=reward_std,
                       tokens=event.tokens, policy_version=event.policy_version, duration_s=event.duration_s,
                       clip_fraction=event.clip_fraction, ratio=event.ratio, kl=event.kl,
                       microsteps=event.microsteps, microsteps_per_replica=event.microsteps_per_replica,
                       staleness_histogram=event.staleness_histogram, phase_s=event.phase_s, epoch=event.epoch)
            if fresh:  # a resumed run's earlier process wrote this step's scalars
                self._scalars(event.step, {
                    "loss": event.loss, "grad_norm": event.grad_norm, "kl": event.kl,
                    "clip_fraction": event.clip_fraction, "reward_mean": reward_mean, "reward_std": reward_std,
                    "tokens": event.tokens, "step_s": event.duration_s,
                    "staleness_mean": sum(k * v for k, v in hist.items()) / sum(hist.values()) if hist else None,
                    "staleness_max": max(hist) if hist else None})
            self._say(f"step {event.step}: completed — loss {event.loss:.3g}, grad norm {event.grad_norm:.4g}, "
                      f"{event.tokens} tokens trained, policy version {event.policy_version}")
            if len(self.completed) >= steps:
                self.done.set()
        elif isinstance(event, schemas.StepFailed):
            self.failed = event
            self._emit(schemas.StepFailed.NAME, step=event.step, epoch=event.epoch, reason=event.reason,
                       microstep=event.microstep)
            self._say(f"step {event.step}: FAILED — {event.reason}")
            self.done.set()

    def training(self) -> set[str]:
        """The cells whose last reported switch was to training."""
        return {c for c, role in {s["cell"]: s["to"] for s in self.switches}.items() if role == "training"}

    def summary(self, run: str, wall_s: float) -> dict:
        steps = sorted(self.completed)
        # the steps that ran, scored or completed (a run stopped early lists no steps it never reached)
        reached = max([*(k for k, scores in self.rewards.items() if scores), *steps], default=-1) + 1
        rewards_per_step = [
            (sum(self.rewards.get(k, {}).values()) / len(self.rewards[k])) if self.rewards.get(k) else None
            for k in range(reached)
        ]
        return {
            "run": run,
            "steps": len(steps), "steps_planned": self.recipe.run.steps,
            "executions": len(self.finished),
            "group_size": self.recipe.tasks.group_size,
            "executions_by_status": {s: list(self.finished.values()).count(s) for s in set(self.finished.values())},
            "excluded": len(self.excluded),
            "executions_without_calls": len(self.finished.keys() - self.calling),
            "executions_exit_nonzero": len(self.exit_nonzero),
            "calls": self.calls,
            "calls_by_status": dict(sorted(self.calls_by_status.items())),
            "calls_by_policy_version": {str(k): v for k, v in sorted(self.calls_by_version.items())},
            "tokens_generated": self.tokens_generated,
            "tokens_trained": sum(self.completed[k].tokens for k in steps),
            "zero_variance_groups": sum(s.zero_variance_groups for s in self.sealed.values()),
            "grad_norm_per_step": [self.completed[k].grad_norm for k in steps],
            "loss_per_step": [self.completed[k].loss for k in steps],
            "rewards_per_step": rewards_per_step,
            "policy_version": max((self.completed[k].policy_version for k in steps), default=0),
            "switch_s": [s.get("total_s") for s in self.switches if "total_s" in s],
            "mode": self.recipe.run.mode, "cells": self.recipe.cells.count, "switches": switches(self.switches),
            "wall_s": round(wall_s, 2),
        }


class Supervisor:
    """Starts daemon processes and notices when one dies."""

    def __init__(self, run_dir: Path, env: dict[str, str]) -> None:
        self.run_dir = run_dir
        self.env = env
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, module: str, *extra: str) -> None:
        log_path = self.run_dir / "logs" / f"{name}.log"
        with open(log_path, "ab") as log:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", module, "--run-dir", str(self.run_dir), "--log-json", *extra],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env,
                start_new_session=True)

    def dead(self) -> list[tuple[str, int]]:
        return [(n, p.returncode) for n, p in self.procs.items() if p.poll() is not None]

    def stop(self, timeout_s: float = 30.0) -> None:
        stop_processes(self.procs.values(), timeout_s)

    def tail(self, name: str, n: int = 3000) -> str:
        try:
            return (self.run_dir / "logs" / f"{name}.log").read_text(errors="replace")[-n:]
        except OSError:
            return ""


def _install_interrupt(interrupted: asyncio.Event, signals: list[int]) -> None:
    """SIGINT/SIGTERM: append the signal, set `interrupted`. A later one only says that the
    daemons are being stopped: exiting then would leave them and the NATS server behind
    (the stop is bounded: `Supervisor.stop`)."""
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        signals.append(signum)
        if interrupted.is_set():
            print("gyre: already stopping; please wait (daemons are killed after 30 s)", file=sys.stderr)
        interrupted.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)


async def _follow(bus: Bus, progress: Progress, sup: Supervisor, timeout_s: float,
                  interrupted: asyncio.Event) -> str:
    """Follow the run until done, a step fails, a daemon dies, `interrupted` or the timeout;
    returns the outcome."""
    stop = asyncio.Event()
    names = [e.NAME for e in (schemas.RouteUpdated, schemas.ExecutionStarted, schemas.ExecutionFinished, schemas.ExecutionScored,
                              schemas.CallCompleted, schemas.StepSealed, schemas.StepCompleted, schemas.CellSwitched,
                              schemas.StepFailed)]
    follower = asyncio.create_task(bus.replay(names, progress.on_event, stop=stop))
    deadline = time.monotonic() + timeout_s
    outcome = "done"
    try:
        while not progress.done.is_set():
            if follower.done():
                follower.result()
            dead = sup.dead()
            if dead:
                name, code = dead[0]
                print(f"\ngyre: daemon {name} exited with {code}; its log ends with:\n{sup.tail(name)}", file=sys.stderr)
                outcome = "daemon_failed"
                break
            if interrupted.is_set():
                print("\ngyre: interrupted; stopping the daemons", file=sys.stderr)
                outcome = "interrupted"
                break
            if time.monotonic() > deadline:
                print(f"\ngyre: run did not finish within {timeout_s:.0f}s", file=sys.stderr)
                outcome = "timeout"
                break
            try:
                await asyncio.wait_for(progress.done.wait(), 0.5)
            except asyncio.TimeoutError:
                pass
        if progress.failed is not None:
            print(f"\ngyre: step {progress.failed.step} failed: {progress.failed.reason}", file=sys.stderr)
            outcome = "step_failed"
        elif outcome == "done":  # the scheduler returns every training cell to rollout ("run done")
            settle = time.monotonic() + RETURN_WAIT_S
            while progress.training() and time.monotonic() < settle and not interrupted.is_set() and not sup.dead():
                await asyncio.sleep(0.2)
    finally:
        stop.set()
        try:
            await asyncio.wait_for(follower, 5)
        except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - shutting down either way
            follower.cancel()
    return outcome


async def _run(recipe: Recipe, run: str, run_dir: Path, timeout_s: float, daemons: tuple[str, ...] = DAEMONS,
               resumed: bool = False) -> int:
    """resumed: `run_dir` holds a run whose processes all died (handlers.resume): its recipe,
    secrets, model and JetStream store are reused, not made anew."""
    interrupted, signals = asyncio.Event(), []
    _install_interrupt(interrupted, signals)  # before anything that must be stopped exists
    if not resumed:
        (run_dir / "config.json").write_bytes(orjson.dumps(recipe.to_dict(), option=orjson.OPT_INDENT_2))
    # `runs/latest` names this run from its start: what waits for `runs/latest/nats.json`
    # (a reward service, `gyre tap`) must not find the previous run's.
    latest = run_dir.parent / "latest"
    try:
        if latest.is_symlink() or latest.exists():
            latest.unlink()
        latest.symlink_to(run_dir.name)
    except OSError:
        pass
    key_secret, engine_token = _secret(run_dir / "key_secret", resumed), _secret(run_dir / "engine_token", resumed)
    external = os.environ.get("GYRE_NATS_URL")
    server = None
    if external:
        url, token = external, os.environ.get("GYRE_NATS_TOKEN")
    else:
        server = NatsServer.start(run_dir / "nats")
        url, token = server.url, server.token
    try:
        outcome = await _run_with_server(recipe, run, run_dir, timeout_s, url, token, key_secret, interrupted,
                                         daemons, engine_token, resumed)
    finally:
        if server is not None:
            server.stop()
    if outcome == "interrupted":  # the shell's convention: 130 after Ctrl-C, 143 after SIGTERM
        return 128 + (signals[0] if signals else signal.SIGINT)
    return 0 if outcome == "done" else 1


def _secret(path: Path, reuse: bool) -> str:
    """A fresh hex secret written to `path` (0600), or with `reuse` the one there already.
    key_secret: execution keys are HMACs of it; engine_token: the run's engines demand it,
    harnesses never see it."""
    if reuse and path.is_file():
        return path.read_text().strip()
    value = secrets.token_hex(32)
    _write_private(path, value.encode())
    return value


async def _run_with_server(recipe: Recipe, run: str, run_dir: Path, timeout_s: float, url: str,
                           token: str | None, key_secret: str, interrupted: asyncio.Event,
                           daemons: tuple[str, ...] = DAEMONS, engine_token: str = "", resumed: bool = False) -> str:
    """Start the daemons, follow the run, stop them, write and print the summary; returns
    the outcome (`done`, `interrupted`, `timeout`, `daemon_failed`, `step_failed`). engine_token:
    the bearer token the cells' engines demand and the proxy sends (GYRE_ENGINE_TOKEN)."""
    from handlers.daemon import process_identity

    info = {"run": run, "url": url, **process_identity()}
    if token:
        info["token"] = token
    _write_private(run_dir / "nats.json", orjson.dumps(info))
    print(f"gyre: run {run} — directory {run_dir}" + (" (resumed)" if resumed else ""))
    tap = "gyre tap" if run_dir == (Path("runs") / run).resolve() else f"gyre tap --run-dir {run_dir}"
    print(f"gyre: follow its events from another terminal with `{tap}`")
    if "evaluator" not in daemons:
        print("gyre: no built-in evaluator: the run waits for your reward service's execution.scored "
              "(docs/reward-services.md)")

    t0 = time.monotonic()
    from handlers.resume import model_written

    if not recipe.model.dir and not (resumed and model_written(run_dir)):
        from transformers.utils import logging as hf_logging

        from gyre.serving.model import ModelSpec, init_model

        hf_logging.disable_progress_bar()  # its shard-writing bar would break the progress lines
        m = recipe.model
        init_model(run_dir / "model", ModelSpec(layers=m.layers, hidden=m.hidden, heads=m.heads, kv_heads=m.kv_heads,
                                                head_dim=m.hidden // m.heads, intermediate=3 * m.hidden, seed=m.seed))
        if m.warm_start:
            from gyre.learning.warm_start import warm_start

            print(f"gyre: warm start of the model on {m.warm_start!r} ({m.warm_start_steps} supervised steps)", flush=True)
            stats = warm_start(run_dir / "model", m.warm_start, m.warm_start_steps, seed=m.seed)
            print(f"gyre: warm start done in {stats['seconds']} s: success rate ≈ {stats['success']:.3f}", flush=True)
    env = dict(os.environ, GYRE_KEY_SECRET=key_secret, GYRE_ENGINE_TOKEN=engine_token,
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_DISABLE_PROGRESS_BARS="1",  # daemon logs are JSON lines: no tqdm bars in them
               PYTHONUNBUFFERED="1")
    if token:
        env["GYRE_NATS_TOKEN"] = token
    if resumed:
        from handlers.resume import RESUMED_ENV
        env[RESUMED_ENV] = "1"
    sup = Supervisor(run_dir, env)
    progress = Progress(recipe, run_dir / "metrics.jsonl", run_dir / "tensorboard", resumed=resumed)
    bus: Bus | None = None
    outcome = "interrupted"
    try:
        if not interrupted.is_set():
            bus = await Bus.connect(url, token=token, run=run, name="gyre-run", stop=interrupted)
            await bus.ensure_streams()
        if not interrupted.is_set():
            for name in daemons:
                sup.start(name, f"handlers.{name}")
            for i in range(recipe.cells.count):
                sup.start(f"cell{i}", "handlers.cell", "--cell", f"cell{i}")
            sup.start("scheduler", "handlers.scheduler")
            outcome = await _follow(bus, progress, sup, timeout_s, interrupted)
        else:
            print("\ngyre: interrupted before the daemons started", file=sys.stderr)
    except ConnectError as exc:
        if not exc.stopped:
            raise
        print("\ngyre: interrupted before the bus connected", file=sys.stderr)
    finally:
        if sup.procs:  # the daemons' last counters, before they go (handlers.metrics)
            from handlers.metrics import scrape_all
            await asyncio.to_thread(scrape_all, run_dir)
        sup.stop()
        for path in (run_dir / "metrics").glob("*.json"):  # a killed daemon's: its port serves nothing now
            path.unlink(missing_ok=True)
        if bus is not None:
            await bus.close()
        progress.close()
    summary = progress.summary(run, time.monotonic() - t0)
    summary["outcome"] = outcome
    summary["evaluator"] = "built-in" if "evaluator" in daemons else "external"
    try:  # the cells over time, from the scheduler's trace.jsonl (handlers.run_cells)
        from handlers.run_cells import picture
        cells_png = picture(run_dir)
    except Exception as exc:  # noqa: BLE001 - the run is over either way; say why there is no picture
        print(f"gyre: no picture of the cells: {exc!r}", file=sys.stderr)
        cells_png = None
    summary["cells_picture"] = str(cells_png) if cells_png else None
    (run_dir / "summary.json").write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    _print_summary(summary)
    try:
        from handlers.report import write_report
        report = write_report(run_dir)
    except Exception as exc:  # noqa: BLE001 - the run is over either way; say why there is no report
        print(f"gyre: no report: {exc!r}", file=sys.stderr)
    else:
        print(f"gyre: report written to {report}")
    print(f"gyre: the run's outputs are in {run_dir}: summary.json, metrics.jsonl (every execution and step), "
          f"trace.jsonl (the scheduler's facts and actions){', cells.png' if cells_png else ''}, report.html, "
          "weights/v<k>/ (the policy after each step), logs/")
    return outcome


def _positive_seconds(text: str) -> float:
    """--timeout's value: a finite number of seconds > 0 (argparse makes anything else a usage error, exit 2)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gyre run", description="Run a recipe: rollouts, trajectories, GSPO steps.")
    p.add_argument("recipe", nargs="?", help="bundled recipe name (quickstart, toy) or a TOML path")
    p.add_argument("--resume", metavar="RUN_DIR",
                   help="go on with the run in RUN_DIR after all its processes died (a reboot, kill -9): from its "
                        "last completed step, with weights, optimizer, learning-rate schedule and RNG state "
                        "restored; executions scored are not run again, those cut short are scored as timed out on "
                        "their workspace (docs/operations.md, 'Resuming a run'). Takes no recipe, --set or --run-id")
    p.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE", help="override a recipe value")
    p.add_argument("--run-id", help="run id (default: <recipe name>-<UTC time>-<random>)")
    p.add_argument("--timeout", type=_positive_seconds, default=3600.0,
                   help="give up after this many seconds, > 0 (default 3600)")
    p.add_argument("--no-evaluator", action="store_true",
                   help="start no built-in evaluator: an external reward service scores the executions "
                        "(docs/reward-services.md)")
    a = p.parse_args(argv)
    if a.resume or not a.recipe:
        if not a.resume or a.recipe or a.set or a.run_id:
            p.error("give a RECIPE, or --resume RUN_DIR without a recipe, --set or --run-id")
        from handlers.resume import main as resume_main
        return resume_main(Path(a.resume), a.timeout, a.no_evaluator)
    try:
        recipe = load_recipe(a.recipe, _parse_overrides(a.set))
    except RecipeError as exc:
        print(f"gyre run: {exc}", file=sys.stderr)
        return 2
    if recipe.cells.transfer == "mooncake":  # say it before anything starts, not in a cell's log
        from handlers.transfer.mooncake import refusal

        why = refusal(recipe.cells.transfer_cluster)
        if why is not None:
            print(f"gyre run: cells.transfer = mooncake: {why}", file=sys.stderr)
            return 2
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    run = a.run_id or f"{recipe.run.name}-{stamp}-{secrets.token_hex(2)}"
    try:
        check_run(run)
    except ValueError as exc:
        where = "--run-id" if a.run_id else "run.name (the run id starts with it)"
        print(f"gyre run: {where}: {exc}", file=sys.stderr)
        return 2
    run_dir = runs_root() / run
    if run_dir.exists():
        print(f"gyre run: {run_dir} exists already", file=sys.stderr)
        return 2
    (run_dir / "logs").mkdir(parents=True)
    return start(recipe, run, run_dir, a.timeout, a.no_evaluator)


def start(recipe: Recipe, run: str, run_dir: Path, timeout_s: float, no_evaluator: bool, resumed: bool = False) -> int:
    """Run `run` in `run_dir` (its logs/ made) to its end; the exit status (module docstring)."""
    from handlers.daemon import configure_logging, release_stdlib_logging

    # The console is for progress and the summary; this process's own log lines go beside
    # the daemons' (logs/run.log), failures are printed where they happen.
    with open(run_dir / "logs" / "run.log", "a", buffering=1) as log_file:
        configure_logging("run", file=log_file)
        try:
            daemons = tuple(d for d in DAEMONS if not (no_evaluator and d == "evaluator"))
            return asyncio.run(_run(recipe, run, run_dir, timeout_s, daemons, resumed))
        except BusError as exc:  # GYRE_NATS_URL unreachable or without JetStream: one line
            print(f"gyre run: {exc}", file=sys.stderr)
            return 1
        finally:  # the run is over: a late Ctrl-C must not interrupt the interpreter's exit
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            release_stdlib_logging()  # its file closes here


if __name__ == "__main__":
    raise SystemExit(main())
