"""Evaluator daemon: scores preserved workspaces with the task's hidden tests.

Consumes `execution.finished` (durable `evaluator-v1`) and publishes `execution.scored`
(id `<run>:<execution>:scored:<attempt>`):
- status `no_workspace` → `placeholder` (reward 0; DESIGN.md "Trajectory processing");
- status `harness_error`, unknown task, or a missing workspace → `excluded` with reason
  (nothing the policy did is being judged);
- otherwise (`ok`, `timeout`: partial credit) the workspace is copied to
  `<run_dir>/eval/<execution>/a<attempt>/`, the hidden tests are written into the copy
  and run confined like a harness (gyre.env.sandbox) with the task's `test_timeout_s`;
  reward = passed / total (gyre.env.tasks.grade). A task with an exact answer and no
  hidden tests (`Task.expected`) is graded in this process instead, by reading the
  workspace's answer files without following links (gyre.env.tasks.grade_expected). An infrastructure failure (`GradeError`,
  a sandbox that cannot start) is retried after `retry_delay_s`, up to `retries` more
  attempts; then the execution is `excluded` with the last reason. Never a reward of 0
  for an evaluator crash.

Idempotent: the published result is recorded in `<run_dir>/evaluator/<execution>.json`
(with the failed-attempt count kept in `.attempts`); a redelivered event re-publishes the
recorded result under its original id.

Restart (kill -9): nothing in memory is needed. The `execution.finished` events it was
grading (unacked) come back after `evaluator-v1`'s ack_wait (120 s): one whose result was
recorded (killed between the record and its ack) is republished under the same id; any
other is graded again from a fresh copy of the preserved workspace (the cut-short copy
`eval/<execution>/a<attempt>/` is removed first), as the same attempt: an evaluator crash
never costs the execution an attempt nor gives it a reward of 0. Cost: those executions'
scores come up to the ack_wait late (tests/test_crash_daemons.py).
"""
from __future__ import annotations

import asyncio
import dataclasses
import shutil
import sys
import time
from pathlib import Path

import structlog

import schemas
from bus import Bus, Retry
from gyre.env.harness import python_installation
from gyre.env.sandbox import SandboxConfig, base_env, confine, own_tree, resolve_mode
from gyre.env.tasks import (Grade, GradeError, Task, grade, grade_expected, load_tasks, prepare_grading,
                            task_index)
from handlers.daemon import FatalError, RunContext, connected, daemon_main
from handlers.runner import wait_or_kill
from schemas import ids

log = structlog.get_logger()


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """The evaluator's settings. run, nats_url, nats_token: the bus (`handlers.daemon.BusSettings`)."""

    run: str
    nats_url: str
    nats_token: str | None
    run_dir: Path
    """The run directory (eval/, evaluator/ inside)."""
    tasks: str
    """Task set whose hidden tests grade: the recipe's `tasks.set` (bundled name or JSONL path)."""
    python: str = sys.executable
    """Interpreter whose bin directory leads PATH for the test command (pytest there)."""
    retries: int = 2
    """Further attempts after an infrastructure failure before `excluded`, >= 0."""
    retry_delay_s: float = 5.0
    """Seconds before a failed attempt is retried (nak delay), >= 0."""
    per_test_timeout_s: float = 30.0
    """Limit of one hidden test, seconds, >= 0 (0 = none); the whole run has the task's test_timeout_s."""
    concurrency: int = 4
    """Workspaces graded at once, >= 1."""
    keep_scratch: bool = False
    """Keep graded copies (a failed attempt's copy is kept anyway)."""
    sandbox: SandboxConfig = SandboxConfig()
    """Confinement of the test run (the same as the harnesses')."""

    def __post_init__(self) -> None:
        if self.retries < 0:
            raise ValueError(f"evaluator retries must be >= 0, got {self.retries}")
        if self.retry_delay_s < 0 or self.per_test_timeout_s < 0:
            raise ValueError("evaluator retry_delay_s and per_test_timeout_s must be >= 0")
        if self.concurrency < 1:
            raise ValueError(f"evaluator concurrency must be >= 1, got {self.concurrency}")


def config_from_context(ctx: RunContext, _args=None) -> Config:
    return Config(run=ctx.run, nats_url=ctx.nats_url, nats_token=ctx.nats_token, run_dir=ctx.run_dir,
                  tasks=ctx.recipe.tasks.set)


def triage(event: schemas.ExecutionFinished, task: Task | None) -> tuple[str, str]:
    """What to do with a finished execution before running anything.

    Returns ("placeholder" | "excluded" | "grade", reason).
    """
    if event.status == "no_workspace" or not event.workspace:
        return "placeholder", "the workspace never came up"
    if event.status == "harness_error":
        return "excluded", "the harness did not run to completion (harness_error)"
    if task is None:
        return "excluded", f"task {event.info.task!r} is not in the evaluator's task set"
    if not Path(event.workspace).is_dir():
        return "excluded", f"workspace {event.workspace} is missing"
    return "grade", ""


def scored_event(run: str, info: schemas.ExecutionInfo, *, outcome: str, attempt: int, grade_: Grade | None = None,
                 reason: str = "") -> schemas.ExecutionScored:
    """The `execution.scored` fact for one attempt."""
    if outcome == "reward":
        assert grade_ is not None
        return schemas.ExecutionScored(event_id=ids.scored(run, info.execution, attempt), info=info, outcome="reward",
                                       reward=grade_.reward, attempt=attempt, tests_passed=grade_.passed,
                                       tests_total=grade_.total, reason=reason or grade_.note)
    reward = 0.0 if outcome == "placeholder" else None
    return schemas.ExecutionScored(event_id=ids.scored(run, info.execution, attempt), info=info, outcome=outcome,
                                   reward=reward, attempt=attempt, reason=reason)


class Interrupted(Exception):
    """The evaluator is stopping; the test run was killed (not the workspace's fault)."""


async def grade_workspace(task: Task, workspace: Path, scratch: Path, *, sandbox: SandboxConfig,
                          python: str = sys.executable, per_test_timeout_s: float = 30.0,
                          stop: asyncio.Event | None = None) -> Grade:
    """Run `task`'s hidden tests on a copy of `workspace` in `scratch` (must not exist),
    confined, for at most task.test_timeout_s seconds. Returns the Grade; raises
    GradeError on an infrastructure failure, Interrupted when `stop` is set meanwhile."""
    try:
        plan = await asyncio.to_thread(prepare_grading, task, Path(workspace), Path(scratch),
                                       per_test_timeout_s=per_test_timeout_s)
        home = Path(scratch) / "home"
        home.mkdir()
        for d in (plan.workdir, plan.out_dir, home):
            await asyncio.to_thread(own_tree, d, sandbox.uid, sandbox.gid)
        env = base_env(home=home, path_dirs=[str(Path(python).parent)], extra=plan.env)
        launch = confine(plan.argv, cwd=plan.workdir, env=env, cfg=sandbox, writable=[plan.out_dir, home],
                         readonly=[*python_installation(python), str(plan.plugin_dir)])
    except (OSError, ValueError, RuntimeError) as exc:
        raise GradeError(f"could not prepare the graded copy: {exc}") from exc
    out_log = Path(scratch) / "pytest.log"
    timed_out = False
    with open(out_log, "wb") as out:
        try:
            proc = await asyncio.create_subprocess_exec(*launch.argv, stdout=out, stderr=asyncio.subprocess.STDOUT,
                                                        **launch.popen_kwargs())
        except OSError as exc:
            raise GradeError(f"could not start the test run: {exc}") from exc
        outcome = await wait_or_kill(proc, task.test_timeout_s, stop)
        if outcome == "stopped":
            raise Interrupted("evaluator stopping")
        timed_out = outcome == "timeout"
        code = None if timed_out else proc.returncode
    tail = out_log.read_text(encoding="utf-8", errors="replace")[-2000:]
    return grade(task, junit_path=plan.junit_path, progress_path=plan.progress_path, exit_code=code,
                 timed_out=timed_out, output_tail=tail)


class Evaluator:
    """Scores `execution.finished` events; see the module docstring."""

    def __init__(self, cfg: Config, bus: Bus, tasks: dict[str, Task], stop: asyncio.Event | None = None) -> None:
        self.cfg = cfg
        self.bus = bus
        self.tasks = tasks
        self.stop = stop
        self.root = Path(cfg.run_dir).resolve()
        (self.root / "evaluator").mkdir(parents=True, exist_ok=True)
        (self.root / "eval").mkdir(parents=True, exist_ok=True)
        (self.root / "eval").chmod(0o711)
        try:
            mode, warning = resolve_mode(cfg.sandbox)
        except RuntimeError as exc:  # no way to confine graders here: say why and how to fix it, once
            raise FatalError(str(exc)) from None
        if warning:
            log.warning("evaluator.sandbox.weak", mode=mode, reason=warning)

    def _record(self, execution: str) -> Path:
        return self.root / "evaluator" / f"{execution}.json"

    async def handle(self, event: schemas.Event) -> None:
        if not isinstance(event, schemas.ExecutionFinished):
            return
        info = event.info
        elog = log.bind(execution=info.execution, task=info.task, status=event.status)
        record = self._record(info.execution)
        if record.exists():
            await self.bus.publish(schemas.decode(schemas.ExecutionScored.NAME, record.read_bytes()))
            elog.info("evaluator.already_scored")
            return
        attempts_path = record.with_suffix(".attempts")
        failures = int(attempts_path.read_text()) if attempts_path.exists() else 0
        task = self.tasks.get(info.task)
        action, reason = triage(event, task)
        if action != "grade":
            await self._publish(scored_event(self.cfg.run, info, outcome=action, attempt=failures, reason=reason), elog)
            return
        scratch = self.root / "eval" / info.execution / f"a{failures}"
        if scratch.exists():
            shutil.rmtree(scratch)  # left by an attempt cut short (restart)
        started = time.monotonic()
        if task.expected and not task.test_files:
            result = await asyncio.to_thread(grade_expected, task, Path(event.workspace))
            elog.info("evaluator.graded", reward=result.reward, passed=result.passed, total=result.total,
                      note=result.note, duration_s=round(time.monotonic() - started, 3))
            await self._publish(scored_event(self.cfg.run, info, outcome="reward", attempt=failures, grade_=result),
                                elog)
            return
        try:
            result = await grade_workspace(task, Path(event.workspace), scratch, sandbox=self.cfg.sandbox,
                                           python=self.cfg.python, per_test_timeout_s=self.cfg.per_test_timeout_s,
                                           stop=self.stop)
        except Interrupted as exc:
            raise Retry(1.0, "evaluator stopping") from exc
        except GradeError as exc:
            failures += 1
            attempts_path.write_text(str(failures))
            if failures <= self.cfg.retries:
                elog.warning("evaluator.attempt.failed", attempt=failures - 1, error=str(exc),
                             retry_in_s=self.cfg.retry_delay_s)
                raise Retry(self.cfg.retry_delay_s) from exc
            await self._publish(scored_event(self.cfg.run, info, outcome="excluded", attempt=failures - 1,
                                             reason=f"evaluator failed {failures} times: {exc}"), elog)
            return
        if not self.cfg.keep_scratch:
            await asyncio.to_thread(_remove_scratch, scratch)
        elog.info("evaluator.graded", reward=result.reward, passed=result.passed, total=result.total,
                  note=result.note, duration_s=round(time.monotonic() - started, 3))
        await self._publish(scored_event(self.cfg.run, info, outcome="reward", attempt=failures, grade_=result), elog)

    async def _publish(self, event: schemas.ExecutionScored, elog) -> None:
        record = self._record(event.info.execution)
        tmp = record.with_suffix(".tmp")
        tmp.write_bytes(schemas.encode(event))
        tmp.replace(record)
        await self.bus.publish(event)
        elog.info("evaluator.scored", outcome=event.outcome, reward=event.reward, attempt=event.attempt,
                  reason=event.reason or None)


async def run(cfg: Config, stop: asyncio.Event) -> None:
    tasks = task_index(load_tasks(cfg.tasks))
    async with connected(cfg, stop, "evaluator") as bus:
        evaluator = Evaluator(cfg, bus, tasks, stop)
        await bus.consume("evaluator-v1", evaluator.handle, stop=stop, concurrency=cfg.concurrency)


def _remove_scratch(scratch: Path) -> None:
    """Remove a graded attempt's copy, and the execution's folder once nothing else is in it
    (a failed attempt's copy stays for a look)."""
    shutil.rmtree(scratch, True)
    try:
        scratch.parent.rmdir()
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    return daemon_main("evaluator", "Evaluator: hidden tests on preserved workspaces → execution.scored.",
                       config_from_context, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
