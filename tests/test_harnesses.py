"""Real, unmodified harnesses through the real proxy, launched confined by the runner.

Claude Code (`claude -p`, Anthropic Messages), mini-swe-agent (tool-call and text-based
configurations, Chat Completions) and Codex CLI (`codex exec`, Responses) run
concurrently behind one proxy, on a real nats-server:
- against the scripted engine driven by a playbook (handlers/engines/scripted.py), each
  completes its task through tool calls: the files it wrote are asserted on its
  workspace; Claude Code delegates to a sub-agent and is then compacted
  (`claude -p /compact --resume <session>`), so its call tree has `main`, `sub-agent`
  and `main-summary` leaves;
- against the tiny random model behind the embedded engine (handlers/engines/embedded.py),
  each runs to its end (exits by itself, or its timeout stops it).
Codex delegates to a sub-agent through its `multi_agent_v1` namespace tools, and the
sub-agent's calls are recorded as `sub-agent`.
Claude Code's interactive screen, typed into through tmux, brings the calls headless runs
never make (a title call, `/context`'s count_tokens calls): they are recorded as
`auxiliary`.
Every call must be recorded on the bus (`call.completed`, read back from JetStream) with
status ok and drift 0, and no proxy response may carry a 4xx/5xx status.

A harness that is not installed (ops/install.sh) is skipped, or fails when CI is set
(`CI=true`, as .ci/run and CI services set it, or `1`/`yes`).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
from pathlib import Path

import pytest
from aiohttp import web

import schemas
from bus import Bus, BusConfig
from gyre.env import harness as harnesses
from gyre.serving.roles import CODEX_COMPACT_REQUEST
from gyre.env.sandbox import SandboxConfig, base_env, confine
from gyre.env.tasks import load_tasks
from gyre.serving.tokenizer import build_tokenizer
from gyre.trajectory.tree import build_tree, trajectories
from handlers import runner as runner_mod
from handlers.engines.client import make_session
from handlers.proxy.daemon import Config as ProxyConfig
from handlers.proxy.app import make_app
from handlers.proxy.state import ProxyState
from handlers.runner import Config as RunnerConfig
from handlers.runner import Paths, wait_or_kill
from handlers.engines.scripted import Playbook, Rule, ScriptedEngine, tool_call
from schemas import ids

pytestmark = pytest.mark.harness

SECRET = bytes(range(7, 39))
CI = os.environ.get("CI", "").lower() in ("true", "1", "yes")
ADD_PY = "def add(a, b):\n    return a + b\n"
TASK = {
    "instance_id": "add",
    "problem_statement": "Create add.py defining add(a, b), which returns a + b.",
    "test_files": {"test_add.py": "from add import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"},
    "timeout_s": 180,
}
SUBTASK = "SUBTASK-7f3: write sub.txt holding the word delegated, then report back."
COMPACT_MARK = "Your task is to create a detailed summary of the conversation"


def wanted(profiles: list[str]) -> list[str]:
    """The profiles installed here (the rest skipped, or a failure under CI=true)."""
    out = [p for p in profiles if harnesses.installed(p)]
    missing = [p for p in profiles if p not in out]
    if missing and CI:
        pytest.fail(f"harnesses not installed (run ops/install.sh): {missing}")
    if not out:
        pytest.skip(f"no harness installed of {missing}")
    if missing:
        print(f"skipping harnesses not installed: {missing}")
    return out


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture
def run_dir(sandbox_dir):
    """A run directory outside /tmp's sticky root, traversable by the sandbox uid."""
    return sandbox_dir / "run"


class Stack:
    """Proxy (recording every response status) + runner + bus reader over one engine URL."""

    def __init__(self, tok, nats_server, run_id: str, run_dir: Path):
        self.tok, self.nats, self.run_id, self.run_dir = tok, nats_server, run_id, run_dir
        self.statuses: list[tuple[str, str, int]] = []  # (method, path, status) of every proxy response
        self.tasks_file = run_dir.parent / "tasks.jsonl"
        self.tasks_file.write_text(json.dumps(TASK) + "\n")
        self.finished: dict[str, schemas.ExecutionFinished] = {}
        self.calls: dict[str, dict[int, schemas.CallCompleted]] = {}
        self._bg: list[asyncio.Task] = []
        self.stop = asyncio.Event()

    async def start(self, engine_url: str, **proxy_overrides) -> None:
        self.bus = await Bus.connect(self.nats.url, token=self.nats.token, run=self.run_id, name="test",
                                     config=BusConfig(connect_timeout_s=5.0, drain_timeout_s=5.0))
        await self.bus.ensure_streams()
        cfg = ProxyConfig(run=self.run_id, key_secret=SECRET, engine_url=engine_url, retry_timeout_s=30.0,
                          shutdown_grace_s=5.0, **proxy_overrides)
        self.session = make_session()
        self.state = ProxyState(cfg, self.tok, self.session, self.bus)
        app = make_app(self.state)

        async def record(request: web.Request, response: web.StreamResponse) -> None:
            self.statuses.append((request.method, request.path, response.status))

        app.on_response_prepare.append(record)
        self.web = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self.web.setup()
        site = web.TCPSite(self.web, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.web.addresses[0][1]}"
        rcfg = RunnerConfig(run=self.run_id, nats_url=self.nats.url, nats_token=self.nats.token,
                            run_dir=self.run_dir, tasks=str(self.tasks_file), key_secret=SECRET.hex(),
                            proxy_url=self.url, concurrency=8,
                            context_tokens=proxy_overrides.get("context_tokens", 0))
        self.runner_cfg = rcfg
        self._bg.append(asyncio.create_task(runner_mod.run(rcfg, self.stop)))
        self._bg.append(asyncio.create_task(self.bus.replay(["execution.started", "execution.finished", "call.completed"],
                                                            self._seen,
                                                            stop=self.stop, poll_s=0.2)))

    async def _seen(self, event) -> None:
        # The proxy learns each execution's harness from execution.started, as in `gyre run`;
        # execution.finished is not passed on, so Claude Code's later /compact still extends.
        if isinstance(event, schemas.ExecutionStarted):
            await self.state.handle_event(event)
        elif isinstance(event, schemas.ExecutionFinished):
            self.finished[event.info.execution] = event
        elif isinstance(event, schemas.CallCompleted):
            self.calls.setdefault(event.execution, {})[event.seq] = event

    async def dispatch(self, execution: str, profile: str, *, timeout_s: float, max_calls: int = 0) -> None:
        info = schemas.ExecutionInfo(execution=execution, task="add", group="s0-g0", step=0, harness=profile,
                                     group_size=1, step_groups=1)
        await self.bus.publish(schemas.ExecutionDispatched(event_id=ids.dispatched(self.run_id, execution),
                                                           info=info, timeout_s=timeout_s, max_calls=max_calls))

    async def wait_finished(self, executions, bound_s: float) -> None:
        async def poll():
            while not set(executions) <= set(self.finished):
                await asyncio.sleep(0.2)
        await asyncio.wait_for(poll(), bound_s)

    async def recorded_calls(self, execution: str, bound_s: float = 30.0) -> list[schemas.CallCompleted]:
        """Every call.completed of `execution`, once the bus holds as many as the proxy served."""
        ex = self.state.executions.get(execution)
        expected = ex.next_seq if ex else 0

        async def poll():
            while len(self.calls.get(execution, {})) < expected:
                await asyncio.sleep(0.1)
        await self.state.drain(bound_s)
        await asyncio.wait_for(poll(), bound_s)
        return [self.calls[execution][s] for s in sorted(self.calls.get(execution, {}))]

    def log(self, execution: str) -> str:
        path = Paths.of(self.run_dir, execution).log
        return path.read_text(errors="replace")[-4000:] if path.exists() else "(no log)"

    async def close(self) -> None:
        self.stop.set()
        await asyncio.gather(*self._bg, return_exceptions=True)
        await self.state.drain(5)
        await self.web.cleanup()
        await self.session.close()
        await self.bus.close()


def assert_recorded(stack: Stack, execution: str, calls: list[schemas.CallCompleted], *, statuses=("ok",)) -> None:
    assert calls, f"{execution}: no call recorded\n{stack.log(execution)}"
    bad = [(c.seq, c.status, c.finish_reason) for c in calls if c.status not in statuses]
    assert not bad, f"{execution}: calls not ok {bad}\n{stack.log(execution)}"
    drift = [(c.seq, c.drift) for c in calls if c.drift]
    assert not drift, f"{execution}: drift {drift}"


def assert_no_proxy_errors(stack: Stack) -> None:
    errors = [s for s in stack.statuses if s[2] >= 400]
    assert not errors, f"the proxy answered errors: {errors}"


# ---- the scripted playbook --------------------------------------------------------------------

def write_add(workspace: Path) -> str:
    return "printf 'def add(a, b):\\n    return a + b\\n' > add.py && echo written"


def playbook(run_dir: Path) -> Playbook:
    ws = lambda e: str(Paths.of(run_dir, e).workspace)  # noqa: E731
    done = "The task is complete: add.py defines add(a, b)."
    rules = [
        # mini-swe-agent (bash tool), then its text-based variant (fenced commands)
        Rule(name="mini-tool", execution="mini-tool", turns=(
            tool_call("bash", {"command": write_add(Path(ws("mini-tool")))}),
            tool_call("bash", {"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}))),
        Rule(name="mini-text", execution="mini-text", turns=(
            f"THOUGHT: write the file.\n\n```mswea_bash_command\n{write_add(Path(ws('mini-text')))}\n```",
            "THOUGHT: done.\n\n```mswea_bash_command\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n```")),
        # Claude Code: compaction, the sub-agent, then the main line
        Rule(name="claude-compact", execution="claude", last=COMPACT_MARK, turns=(
            "<analysis>The user asked for add.py; it was written, and a sub-agent wrote sub.txt.</analysis>\n\n"
            "<summary>\n1. Primary Request and Intent: create add.py with add(a, b).\n"
            "2. Files: add.py written; sub.txt written by a sub-agent.\n3. Pending Tasks: none.\n</summary>",)),
        Rule(name="claude-sub", execution="claude", first="SUBTASK-7f3", turns=(
            tool_call("Bash", {"command": "printf delegated > sub.txt", "description": "Write sub.txt"}),
            "sub.txt written.")),
        Rule(name="claude-main", execution="claude", first="add.py", turns=(
            tool_call("Agent", {"description": "Write sub.txt", "prompt": SUBTASK, "subagent_type": "general-purpose"}),
            tool_call("Write", {"file_path": ws("claude") + "/add.py", "content": ADD_PY}),
            done)),
        Rule(name="claude-side", execution="claude", turns=("OK",)),
        # Codex CLI
        Rule(name="codex", execution="codex", turns=(
            tool_call("exec_command", {"cmd": write_add(Path(ws("codex")))}),
            done)),
    ]
    return Playbook(rules)


async def compact_claude(stack: Stack, execution: str) -> int:
    """`claude -p /compact --resume <session>` in the execution's home and workspace, confined
    like the runner does; returns its exit code."""
    paths = Paths.of(stack.run_dir, execution)
    text = paths.log.read_text(errors="replace")
    found = re.findall(r'"session_id"\s*:\s*"([0-9a-f-]{36})"', text)
    assert found, f"no session id in Claude Code's output\n{text[-3000:]}"
    task = load_tasks(str(stack.tasks_file))[0]
    relay = runner_mod.Runner(stack.runner_cfg, None, {})  # the proxy reached as the runner's harnesses reach it
    network, proxy_url = await relay.sandbox_network(stack.url)
    req = harnesses.LaunchRequest(execution=execution, task=task, workspace=paths.workspace, home=paths.home,
                                  proxy_url=proxy_url, api_key=harnesses.execution_key(SECRET, execution),
                                  model="gyre")
    cmd = harnesses.get_profile("claude-code")(req)
    argv = [cmd.argv[0], "-p", "/compact", "--resume", found[-1], "--output-format", "json", "--model", "gyre"]
    env = base_env(home=paths.home, path_dirs=cmd.path_dirs, extra=cmd.env)
    launch = confine(argv, cwd=paths.workspace, env=env, cfg=SandboxConfig(), writable=[paths.home],
                     readonly=cmd.readonly, network=network)
    try:
        with open(paths.log, "ab") as out:
            proc = await asyncio.create_subprocess_exec(*launch.argv, stdout=out, stderr=asyncio.subprocess.STDOUT,
                                                        **launch.popen_kwargs())
            outcome = await wait_or_kill(proc, 120, None)
    finally:
        await relay.close()
    assert outcome == "ok", f"/compact did not finish\n{stack.log(execution)}"
    return proc.returncode


EXECUTIONS = {"mini-tool": "mini-swe-agent", "mini-text": "mini-swe-agent-text", "claude": "claude-code",
              "codex": "codex"}


async def test_harnesses_complete_their_task_through_the_proxy(tok, nats_server, run_id, run_dir):
    profiles = wanted(list(EXECUTIONS.values()))
    execs = {e: p for e, p in EXECUTIONS.items() if p in profiles}
    book = playbook(run_dir)
    engine = ScriptedEngine(tok, callback=book.callback(tok))
    await engine.start()
    stack = Stack(tok, nats_server, run_id, run_dir)
    try:
        await stack.start(engine.url)
        for e, p in execs.items():
            await stack.dispatch(e, p, timeout_s=150.0, max_calls=12)
        await stack.wait_finished(execs, 240.0)
        for e in execs:
            done = stack.finished[e]
            assert (done.status, done.exit_code) == ("ok", 0), f"{e}: {done.status} {done.exit_code}\n{stack.log(e)}"
            ws = Paths.of(run_dir, e).workspace
            assert (ws / "add.py").is_file(), f"{e}: add.py missing; matched {book.matched}\n{stack.log(e)}"
            assert (ws / "add.py").read_text() == ADD_PY
        if "claude" in execs:
            ws = Paths.of(run_dir, "claude").workspace
            assert (ws / "sub.txt").read_text() == "delegated", stack.log("claude")
            assert await compact_claude(stack, "claude") == 0, stack.log("claude")
        for e in execs:
            calls = await stack.recorded_calls(e)
            assert_recorded(stack, e, calls)
        assert_no_proxy_errors(stack)
        if "mini-tool" in execs:
            calls = await stack.recorded_calls("mini-tool")
            assert len(calls) == 2 and calls[1].parent_call == calls[0].call and calls[1].prefix_len > 0
        if "codex" in execs:
            calls = await stack.recorded_calls("codex")
            assert {c.api for c in calls} == {"responses"}
        if "claude" in execs:
            calls = await stack.recorded_calls("claude")
            assert {c.api for c in calls} == {"messages"}
            tree = build_tree("claude", calls)
            leaves = {tree.role(leaf) for leaf in tree.leaves()}
            assert {"main", "sub-agent", "main-summary"} <= leaves, (
                leaves, [(c.seq, c.role, c.parent_call) for c in calls], book.matched)
            # The sample the trajectory processor keeps from this tree: main first, then
            # main-summary, then sub-agent (role priority), each policy token once.
            kept = trajectories(tree, j_max=5)
            roles = [t.role for t in kept]
            assert set(roles) == {"main", "sub-agent", "main-summary"}, roles
            order = ["main", "main-summary", "sub-agent", "sub-agent-summary"]
            assert roles == sorted(roles, key=order.index), roles
            assert sum(t.n_trained for t in kept) == sum(
                len(c.tokens.completion_ids) for c in calls if c.role != "auxiliary" and c.status == "ok")
    finally:
        await stack.close()
        await engine.stop()


CODEX_SUBTASK = "SUBTASK-cx9: write sub.txt holding the word delegated, then report back."


def codex_delegation(tok, ws: Path, spawned: list[str]):
    """A scripted Codex main agent that spawns a sub-agent through Codex's
    `multi_agent_v1` namespace tools (their flat names, as the proxy shows them), waits
    for it with the agent id the spawn returned, then writes add.py; the sub-agent writes
    sub.txt. `spawned` collects the spawn tool's outputs (for a failure message)."""
    from handlers.engines.scripted import split_turns

    def cb(body: dict) -> str:
        turns = split_turns(tok.decode(body["input_ids"], skip_special_tokens=False))
        k = turns.assistant_turns
        asked = [b for b in turns.text.split("<|im_start|>") if b.startswith("user\n") and "<tool_response>" not in b]
        if any(CODEX_SUBTASK in b for b in asked):  # the sub-agent: its task is a user message
            return (tool_call("exec_command", {"cmd": "printf delegated > sub.txt && echo ok"}),
                    "sub.txt written.")[min(k, 1)]
        if k == 0:
            return tool_call("multi_agent_v1__spawn_agent", {"message": CODEX_SUBTASK})
        if k == 1:
            spawned.append(turns.last)
            found = re.search(r'"(?:agent_id|id|target)"\s*:\s*"([^"]+)"', turns.last)
            return tool_call("multi_agent_v1__wait_agent",
                             {"targets": [found.group(1) if found else "?"], "timeout_ms": 60000})
        if k == 2:
            return tool_call("exec_command", {"cmd": write_add(ws)})
        return "The task is complete: add.py defines add(a, b); the sub-agent wrote sub.txt."
    return cb


async def test_codex_delegates_to_a_sub_agent_through_its_namespace_tools(tok, nats_server, run_id, run_dir):
    """Codex CLI offers its sub-agent tools as a `namespace` tool (`multi_agent_v1`): the
    policy sees them under flat names, and its calls are answered with the namespace, so
    Codex spawns the sub-agent, whose own calls reach the proxy; both finish their files,
    every call is recorded ok with drift 0, and no response is an error."""
    wanted(["codex"])
    spawned: list[str] = []
    engine = ScriptedEngine(tok, callback=codex_delegation(tok, Paths.of(run_dir, "codex-sub").workspace, spawned))
    await engine.start()
    stack = Stack(tok, nats_server, run_id, run_dir)
    try:
        await stack.start(engine.url)
        await stack.dispatch("codex-sub", "codex", timeout_s=150.0, max_calls=12)
        await stack.wait_finished(["codex-sub"], 200.0)
        done = stack.finished["codex-sub"]
        log = stack.log("codex-sub")
        assert (done.status, done.exit_code) == ("ok", 0), f"{done.status} {done.exit_code}\n{log}"
        ws = Paths.of(run_dir, "codex-sub").workspace
        assert (ws / "sub.txt").read_text() == "delegated", f"spawn said {spawned}\n{log}"
        assert (ws / "add.py").read_text() == ADD_PY, log
        calls = await stack.recorded_calls("codex-sub")
        assert_recorded(stack, "codex-sub", calls)
        assert_no_proxy_errors(stack)
        subs = [c for c in calls if c.role == "sub-agent"]
        assert subs, [(c.seq, c.role, c.meta) for c in calls]
        assert spawned and re.search(r'"(?:agent_id|id|target)"\s*:\s*"[^"?]+"', spawned[0]), spawned
        tree = build_tree("codex-sub", calls)
        assert {tree.role(leaf) for leaf in tree.leaves()} == {"main", "sub-agent"}, [
            (c.seq, c.role, c.parent_call, c.meta.get("agent_id")) for c in calls]
    finally:
        await stack.close()
        await engine.stop()


@contextlib.asynccontextmanager
async def finished_in_context(tok, nats_server, run_id, run_dir, answer, context: int, execution: str, profile: str,
                              max_calls: int):
    """One execution of `profile` against a scripted engine (`answer`) that enforces a
    `context`-token window as SGLang does, the proxy and the runner told that context; it
    must finish `ok` with exit 0. Yields (stack, its recorded calls), then stops both."""
    engine = ScriptedEngine(tok, callback=answer, context_length=context)
    await engine.start()
    stack = Stack(tok, nats_server, run_id, run_dir)
    try:
        await stack.start(engine.url, context_tokens=context)
        await stack.dispatch(execution, profile, timeout_s=150.0, max_calls=max_calls)
        await stack.wait_finished([execution], 200.0)
        done = stack.finished[execution]
        assert (done.status, done.exit_code) == ("ok", 0), f"{done.status} {done.exit_code}\n{stack.log(execution)}"
        yield stack, await stack.recorded_calls(execution)
    finally:
        await stack.close()
        await engine.stop()


async def test_claude_code_compacts_when_the_proxy_says_its_prompt_is_too_long(tok, nats_server, run_id, run_dir):
    """A rollout that outgrows the policy's context: the proxy answers Anthropic's "prompt is
    too long" (context_tokens known, the engine enforcing the same context as SGLang does),
    and Claude Code compacts and goes on to finish. With the engine's refusal passed on as a
    generic 400 it exited 1 after four calls."""
    wanted(["claude-code"])
    context = 30_000  # Claude Code's system prompt and tools alone are ≈ 18.7k tokens
    state = {"after_summary": 0}

    def answer(body: dict) -> str:
        text = tok.decode(body["input_ids"][-3000:], skip_special_tokens=False)
        if COMPACT_MARK in text or "Respond with TEXT ONLY" in text:
            state["after_summary"] = 0
            return "<summary>1. Primary Request: print 1..600 with Bash, many times. 2. Pending: go on.</summary>"
        if "Summary:" in tok.decode(body["input_ids"][:30000], skip_special_tokens=False):
            state["after_summary"] += 1
            if state["after_summary"] > 2:
                return "Done: the numbers were printed."
        return tool_call("Bash", {"command": "seq 1 600", "description": "print the numbers"})

    async with finished_in_context(tok, nats_server, run_id, run_dir, answer, context, "claude", "claude-code",
                                   max_calls=40) as (stack, calls):
        assert_recorded(stack, "claude", calls, statuses=("ok", "error"))
        refused = [c for c in calls if c.status == "error"]
        assert refused, [(c.seq, c.status, c.role) for c in calls]
        assert [s for s in stack.statuses if s[2] >= 400] == [("POST", "/v1/messages", 400)] * len(refused)
        roles = [c.role for c in calls if c.status == "ok"]
        # the compaction request and the line continued after it are `main-summary` (gyre.serving.roles)
        assert roles[0] == "main" and roles[-1] == "main-summary" and len(roles) > roles.index("main-summary") + 1, \
            roles
        assert all(len(c.tokens.prompt_ids) + c.sampling.max_tokens <= context - 2 for c in calls if c.status == "ok")


async def test_codex_compacts_when_told_the_policys_context(tok, nats_server, run_id, run_dir):
    """Codex CLI knows no context window for a model name it does not ship: without one it
    never compacts, and a rollout that outgrows the policy's context ends in `turn.failed`
    (exit 1) on the proxy's `context_length_exceeded`. The runner passes the context on
    (`model_context_window`): Codex compacts before the limit and finishes."""
    wanted(["codex"])
    context = 9_600  # Codex's instructions and tools are ≈ 8.4k tokens (its sub-agent tools ≈ 3k of them)

    def answer(body: dict) -> str:
        text = tok.decode(body["input_ids"], skip_special_tokens=False)
        if CODEX_COMPACT_REQUEST in text[-4000:]:
            return "Summary: printed the numbers 1 to 200 once."
        if "Summary:" in text or "seq 1 200" in text:
            return "Done: the numbers were printed."
        return tool_call("exec_command", {"cmd": "seq 1 200"})

    async with finished_in_context(tok, nats_server, run_id, run_dir, answer, context, "codex", "codex",
                                   max_calls=10) as (stack, calls):
        assert_recorded(stack, "codex", calls)
        assert_no_proxy_errors(stack)
        kinds = [(c.role, c.meta.get("request_kind")) for c in calls]
        assert ("main-summary", "compaction") in kinds and kinds[0][0] == "main", kinds
        assert all(c.status == "ok" for c in calls)


async def test_harnesses_run_to_their_end_on_the_random_model(tok, nats_server, run_id, run_dir, tmp_path):
    from gyre.serving.engine import Engine, EngineConfig
    from gyre.serving.model import init_model
    from handlers.engines import embedded as engine_server

    profiles = wanted(list(EXECUTIONS.values()))
    execs = {e: p for e, p in EXECUTIONS.items() if p in profiles}
    model_dir = init_model(tmp_path / "model")
    engine = Engine(EngineConfig(model_dir=str(model_dir), max_completion_tokens=32))
    _app, eng_runner, engine_url = await engine_server.serve(engine, api_key="engine-token")
    stack = Stack(tok, nats_server, run_id, run_dir)
    try:
        await stack.start(engine_url, max_completion_tokens=32, engine_token="engine-token")
        for e, p in execs.items():
            await stack.dispatch(e, p, timeout_s=90.0, max_calls=3)
        await stack.wait_finished(execs, 200.0)
        for e in execs:
            done = stack.finished[e]
            assert done.status in ("ok", "timeout"), f"{e}: {done.status}\n{stack.log(e)}"
            calls = await stack.recorded_calls(e)
            # a harness stopped by its timeout may leave one call aborted
            assert_recorded(stack, e, calls, statuses=("ok", "aborted") if done.status == "timeout" else ("ok",))
        assert_no_proxy_errors(stack)
    finally:
        await stack.close()
        await eng_runner.cleanup()


# ---- pure: profiles and the playbook -----------------------------------------------------------

def test_npm_profiles_build_their_command_lines(tmp_path):
    import tomllib

    task = load_tasks("toy")[0]
    req = harnesses.LaunchRequest(execution="e1", task=task, workspace=tmp_path / "ws", home=tmp_path / "home",
                                  proxy_url="http://127.0.0.1:9/", api_key="gyre-e1-k", model="gyre", max_calls=4)
    cc = harnesses.get_profile("claude-code")(req)
    assert cc.argv[0].endswith("/bin/claude") and cc.argv[1:3] == ["-p", task.problem_statement]
    assert cc.argv[cc.argv.index("--allowedTools") + 1] == "Bash Write Read Edit Agent"
    assert cc.argv[cc.argv.index("--permission-mode") + 1] == "acceptEdits"
    assert cc.argv[cc.argv.index("--max-turns") + 1] == "4" and "--output-format" in cc.argv
    assert cc.env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:9" and cc.env["ANTHROPIC_API_KEY"] == "gyre-e1-k"
    for flag in ("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "DISABLE_TELEMETRY", "DISABLE_AUTOUPDATER",
                 "DISABLE_ERROR_REPORTING", "DISABLE_BUG_COMMAND"):
        assert cc.env[flag] == "1"
    assert cc.env["TMPDIR"] == str(tmp_path / "home" / "tmp") and "tmp/.keep" in cc.files
    assert str(harnesses.harness_prefix()) in cc.readonly
    cx = harnesses.get_profile("codex")(req)
    assert cx.argv[1:] == ["exec", "--skip-git-repo-check", "--json", task.problem_statement]
    assert cx.env["CODEX_HOME"] == str(tmp_path / "home" / ".codex")
    assert cx.env[harnesses.CODEX_KEY_ENV] == "gyre-e1-k"
    conf = tomllib.loads(cx.files[".codex/config.toml"])
    provider = conf["model_providers"][conf["model_provider"]]
    assert provider == {"name": "gyre", "base_url": "http://127.0.0.1:9/v1", "env_key": harnesses.CODEX_KEY_ENV,
                        "wire_api": "responses"}
    assert (conf["model"], conf["approval_policy"], conf["sandbox_mode"]) == ("gyre", "never", "danger-full-access")
    assert conf["check_for_update_on_startup"] is False and conf["analytics"]["enabled"] is False
    assert "model_context_window" not in conf  # not known: Codex's own default
    windowed = harnesses.get_profile("codex")(dataclasses.replace(req, context_tokens=32768))
    assert tomllib.loads(windowed.files[".codex/config.toml"])["model_context_window"] == 32768


def test_playbook_picks_rule_and_turn_from_the_prompt(tok):
    book = Playbook([
        Rule(name="compact", last="summary of the conversation", turns=("S",)),
        Rule(name="sub", first="SUBTASK", turns=("s0", "s1")),
        Rule(name="main", execution="ex", turns=("m0", "m1", "m2")),
    ])
    cb = book.callback(tok)

    def prompt(*turns):
        text = "".join(f"<|im_start|>{r}\n{t}<|im_end|>\n" for r, t in turns) + "<|im_start|>assistant\n"
        return {"input_ids": tok(text, add_special_tokens=False)["input_ids"], "gyre_execution": "ex"}

    sys_, task = ("system", "You are an agent."), ("user", "Write add.py")
    assert cb(prompt(sys_, task)) == "m0"
    assert cb(prompt(sys_, task, ("assistant", "call"), ("user", "<tool_response>ok</tool_response>"))) == "m1"
    many = [sys_, task] + [("assistant", "a"), ("user", "r")] * 5
    assert cb(prompt(*many)) == "m2"  # past the end: the last turn repeats
    assert cb(prompt(sys_, ("user", "SUBTASK-1: do it"))) == "s0"
    assert cb(prompt(sys_, task, ("assistant", "a"), ("user", "Write a summary of the conversation"))) == "S"
    assert [m[1] for m in book.matched] == ["main", "main", "main", "sub", "compact"]
    with pytest.raises(LookupError):
        Playbook([Rule(execution="other", turns=("x",))]).callback(tok)(prompt(sys_, task))
    assert "<tool_call>\n" in tool_call("bash", {"command": "ls"})


# ---- Claude Code's interactive side calls -----------------------------------------------------

class Tui:
    """A program in a tmux pane of a private tmux server (own socket, no user config), with
    its screen readable and keys sendable; `close()` ends the program and the server."""

    def __init__(self, socket: Path):
        self.socket = socket
        self.pid = 0

    def tmux(self, *args: str, check: bool = True) -> str:
        import subprocess

        done = subprocess.run(["tmux", "-f", "/dev/null", "-S", str(self.socket), *args], capture_output=True,
                              text=True, timeout=30)
        if check and done.returncode:
            raise AssertionError(f"tmux {args[0]} failed ({done.returncode}): {done.stderr.strip()}")
        return done.stdout

    def start(self, cwd: Path, env: dict[str, str], argv: list[str]) -> None:
        # remain-on-exit keeps the pane (and its last screen) if the program dies early
        self.tmux("new-session", "-d", "-x", "160", "-y", "45", "-c", str(cwd), "env", "-i",
                  *(f"{k}={v}" for k, v in env.items()), *argv, ";", "set-option", "remain-on-exit", "on")
        self.pid = int(self.tmux("display-message", "-p", "#{pane_pid}").strip())

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", check=False)

    def dead(self) -> bool:
        return self.tmux("display-message", "-p", "#{pane_dead}", check=False).strip() == "1"

    async def until(self, what: str, check, bound_s: float = 60.0) -> None:
        deadline = asyncio.get_running_loop().time() + bound_s
        while not check():
            if self.dead() or asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"gave up waiting for {what} (program exited: {self.dead()})\n{self.screen()}")
            await asyncio.sleep(0.2)

    async def close(self) -> None:
        import signal

        self.tmux("kill-server", check=False)
        for _ in range(50):  # the program outlives its tmux server for a moment
            if not self.pid or not _running(self.pid):
                break
            await asyncio.sleep(0.1)
        else:
            os.kill(self.pid, signal.SIGKILL)
        self.socket.unlink(missing_ok=True)


def _running(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status  # a zombie has exited


async def test_interactive_claude_code_title_and_count_tokens_are_auxiliary(tok, nats_server, run_id, run_dir):
    """Claude Code's interactive screen, typed into through tmux as a user would (HARNESSES.md:
    title and count_tokens calls come only from interactive use): a first prompt brings
    the title call (`tools: []`, a JSON-schema output) beside the main call, and `/context`
    brings its count_tokens calls. All are answered and recorded; the title and every
    count_tokens call as `auxiliary` (never in the call tree), the main call as `main`.
    Needs tmux (ops/install.sh installs it as root): skipped without it, a failure under
    CI=true."""
    import shutil

    wanted(["claude-code"])
    if shutil.which("tmux") is None:
        if CI:
            pytest.fail("tmux not installed (ops/install.sh installs it)")
        pytest.skip("tmux not installed")
    execution = "cc-tui"
    engine = ScriptedEngine(tok, completions=['{"title": "List the files"}'])
    await engine.start()
    stack = Stack(tok, nats_server, run_id, run_dir)
    tui = Tui(run_dir.parent / "tmux.sock")
    home, ws = run_dir / "tui-home", run_dir / "tui-ws"
    try:
        await stack.start(engine.url)
        info = schemas.ExecutionInfo(execution=execution, task="add", group="s0-g0", step=0, harness="claude-code",
                                     group_size=1, step_groups=1)
        await stack.state.handle_event(schemas.ExecutionStarted(event_id=ids.started(run_id, execution), info=info,
                                                                workspace=str(ws)))
        (home / "tmp").mkdir(parents=True)
        ws.mkdir()
        key = harnesses.execution_key(SECRET, execution)
        # What the first interactive start would ask (theme, trust, this API key), answered.
        (home / ".claude.json").write_text(json.dumps({
            "hasCompletedOnboarding": True, "theme": "dark",
            "customApiKeyResponses": {"approved": [key[-20:]], "rejected": []},
            "projects": {str(ws): {"hasTrustDialogAccepted": True}}}))
        claude = harnesses.harness_prefix() / "bin" / "claude"
        env = {"PATH": f"{claude.parent}:/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "TMPDIR": str(home / "tmp"),
               "TERM": "xterm-256color", "ANTHROPIC_BASE_URL": stack.url, "ANTHROPIC_API_KEY": key,
               "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1",
               "DISABLE_ERROR_REPORTING": "1", "DISABLE_BUG_COMMAND": "1"}
        tui.start(ws, env, [str(claude), "--model", "gyre"])
        await tui.until("Claude Code's input box", lambda: "? for shortcuts" in tui.screen())
        served = lambda: stack.state.executions[execution].next_seq if execution in stack.state.executions else 0  # noqa: E731
        prompt = "please list the files in this folder and say what they are"
        tui.tmux("send-keys", "-l", prompt)
        await tui.until("the typed prompt", lambda: prompt in tui.screen())
        for _ in range(3):  # an Enter that arrives while the screen redraws can be lost
            tui.tmux("send-keys", "Enter")
            try:
                await tui.until("the first calls", lambda: served() >= 1, 10.0)
                break
            except AssertionError:
                if served() or tui.dead():
                    raise
        await tui.until("the main and title calls", lambda: served() >= 2)
        await tui.until("the answer", lambda: not stack.state.active and "? for shortcuts" in tui.screen())
        tui.tmux("send-keys", "-l", "/context")
        await tui.until("the typed /context", lambda: "/context" in tui.screen())
        tui.tmux("send-keys", "Enter")
        await tui.until("/context's report", lambda: "Context Usage" in tui.screen())
        calls = await stack.recorded_calls(execution)
        assert_no_proxy_errors(stack)
        answered = sum(1 for _, path, _ in stack.statuses if path.endswith("/count_tokens"))
        summary = [(c.seq, c.role, c.meta.get("request_kind"), c.status, c.drift) for c in calls]
        assert all(c.status == "ok" and c.drift == 0 for c in calls), summary
        counted = [c for c in calls if c.meta.get("request_kind") == "count_tokens"]
        title = [c for c in calls if c.meta.get("request_kind") == "title"]
        main = [c for c in calls if c.role == "main"]
        assert answered and len(counted) == answered, (answered, summary)
        assert len(title) == 1 and main and len(counted) + len(title) + len(main) == len(calls), summary
        assert all(c.role == "auxiliary" and c.parent_call is None for c in counted + title), summary
        assert all(not c.tokens.completion_ids and c.tokens.prompt_ids for c in counted), summary
        assert all(c.tokens.completion_ids for c in title + main), summary
        tree = build_tree(execution, calls)
        assert {tree.role(leaf) for leaf in tree.leaves()} == {"main"}
        assert {r.call for r in stack.state.executions[execution].store.calls} == {c.call for c in main}
    finally:
        try:
            await tui.close()
        finally:
            await stack.close()
            await engine.stop()
