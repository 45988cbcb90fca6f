"""Runner over a real nats-server: toy and mini-swe-agent harnesses against a fake
OpenAI endpoint (aiohttp on 127.0.0.1, speaking /v1/chat/completions), timeouts,
no_workspace, idempotence under redelivery, execution keys and harness profiles."""
from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
from aiohttp import web

import schemas
from bus import Bus
from gyre.env.harness import LaunchRequest, execution_key, get_profile, verify_key
from gyre.env.tasks import load_tasks, task_index
from handlers import runner as runner_mod
from handlers.runner import Config, Paths, Runner
from schemas import ids

SECRET = bytes(range(32))
ROOT = os.geteuid() == 0


# ---- execution keys and profiles (pure) ----------------------------------------------------

def test_execution_key_round_trip_and_forgery():
    key = execution_key(SECRET, "s0-g1-e2")
    assert key.startswith("gyre-s0-g1-e2-") and len(key.rsplit("-", 1)[1]) == 32
    assert verify_key(SECRET, key) == "s0-g1-e2"
    assert verify_key(b"other secret", key) is None
    assert verify_key(SECRET, key[:-1] + ("0" if key[-1] != "0" else "1")) is None
    assert verify_key(SECRET, "gyre-s0-g1-e3-" + key.rsplit("-", 1)[1]) is None  # key of another execution
    assert verify_key(SECRET, "sk-something") is None and verify_key(SECRET, "gyre--") is None
    with pytest.raises(ValueError):
        execution_key(b"", "e")


def test_profiles_build_command_lines(tmp_path):
    task = load_tasks("toy")[0]
    req = LaunchRequest(execution="e1", task=task, workspace=tmp_path / "ws", home=tmp_path / "home",
                        proxy_url="http://127.0.0.1:9/", api_key="gyre-e1-k", model="gyre", max_calls=4,
                        python="/opt/venv/bin/python")
    mini = get_profile("mini-swe-agent")(req)
    argv = mini.argv
    assert argv[0] == "/opt/venv/bin/mini" and "-y" in argv and "--exit-immediately" in argv
    assert argv[argv.index("-t") + 1] == task.problem_statement
    assert argv[argv.index("-m") + 1] == "openai/gyre"
    assert "model.model_kwargs.api_base=http://127.0.0.1:9/v1" in argv and "agent.step_limit=4" in argv
    assert argv[argv.index("-o") + 1] == str(tmp_path / "home" / "traj.json")
    assert "mini.yaml" in mini.files and "--model-class" not in argv
    assert mini.env["OPENAI_API_KEY"] == "gyre-e1-k" and mini.env["MSWEA_CONFIGURED"] == "true"
    assert mini.env["MSWEA_GLOBAL_CONFIG_DIR"].startswith(str(tmp_path / "home"))
    text = get_profile("mini-swe-agent-text")(req)
    assert text.argv[text.argv.index("--model-class") + 1] == "litellm_textbased" and "mini_textbased.yaml" in text.files
    toy = get_profile("toy")(req)
    assert toy.env == {"OPENAI_BASE_URL": "http://127.0.0.1:9/v1", "OPENAI_API_KEY": "gyre-e1-k"}
    assert toy.files["task.md"] == task.problem_statement
    with pytest.raises(KeyError, match="known"):
        get_profile("nope")


def test_config_validation(tmp_path):
    base = dict(run="r", nats_url="nats://127.0.0.1:1", nats_token=None, run_dir=tmp_path, tasks="toy")
    with pytest.raises(ValueError, match="hex"):
        Config(**base, key_secret="zz")
    with pytest.raises(ValueError, match="non-empty"):
        Config(**base, key_secret="")
    with pytest.raises(ValueError, match="loopback"):
        Config(**base, key_secret="ab", proxy_url="http://example.com")


# ---- a fake OpenAI endpoint ----------------------------------------------------------------

class FakeOpenAI:
    """Answers /v1/chat/completions from a script chosen by the caller's execution.

    script(execution, n) -> ("text", str) | ("tool", command) | ("hang", None).
    """

    def __init__(self, script, run: str):
        self.script = script
        self.run = run  # answered on /health, as the run's proxy does (the runner waits for it)
        self.requests: list[tuple[str, dict]] = []  # (execution, body)
        self.runner: web.AppRunner | None = None
        self.url = ""
        self.released = asyncio.Event()

    async def start(self) -> "FakeOpenAI":
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/health", self.health)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "run": self.run})

    async def stop(self) -> None:
        self.released.set()
        await self.runner.cleanup()

    async def chat(self, request: web.Request) -> web.Response:
        key = request.headers.get("Authorization", "").removeprefix("Bearer ")
        execution = verify_key(SECRET, key)
        if execution is None:
            return web.json_response({"error": {"message": "bad key"}}, status=401)
        body = await request.json()
        n = sum(1 for e, _ in self.requests if e == execution)
        self.requests.append((execution, body))
        kind, value = self.script(execution, n)
        if kind == "hang":
            await self.released.wait()
        message: dict = {"role": "assistant", "content": value if kind == "text" else "Running it."}
        finish = "stop"
        if kind == "tool":
            message["tool_calls"] = [{"id": f"call_{n}", "type": "function",
                                      "function": {"name": "bash", "arguments": json.dumps({"command": value})}}]
            finish = "tool_calls"
        return web.json_response({
            "id": f"chatcmpl-{n}", "object": "chat.completion", "created": 0, "model": body.get("model", ""),
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}})


@pytest.fixture
def run_dir(sandbox_dir):
    """A run directory whose ancestors the sandbox uid may traverse (setuid fallback)."""
    return sandbox_dir / "run"


def info(execution: str, task: str, harness: str = "toy") -> schemas.ExecutionInfo:
    return schemas.ExecutionInfo(execution=execution, task=task, group="s0-g0", step=0, harness=harness,
                                 group_size=1, step_groups=1)


def dispatched(run: str, execution: str, task: str, *, harness: str = "toy", timeout_s: float = 60.0,
               max_calls: int = 0) -> schemas.ExecutionDispatched:
    return schemas.ExecutionDispatched(event_id=ids.dispatched(run, execution), info=info(execution, task, harness),
                                       timeout_s=timeout_s, max_calls=max_calls)


class Collector:
    """Replays execution.started / execution.finished into dicts keyed by execution."""

    def __init__(self) -> None:
        self.started: dict[str, schemas.ExecutionStarted] = {}
        self.finished: dict[str, schemas.ExecutionFinished] = {}

    async def __call__(self, event) -> None:
        target = self.started if isinstance(event, schemas.ExecutionStarted) else self.finished
        target[event.info.execution] = event

    async def wait_finished(self, executions, timeout_s: float = 60.0) -> None:
        async def poll():
            while not set(executions) <= set(self.finished):
                await asyncio.sleep(0.05)
        await asyncio.wait_for(poll(), timeout_s)


async def start_runner(cfg: Config, nats_server, run_id):
    bus = await Bus.connect(nats_server.url, token=nats_server.token, run=run_id, name="test")
    await bus.ensure_streams()
    stop = asyncio.Event()
    collector = Collector()
    replay = asyncio.create_task(bus.replay(["execution.started", "execution.finished"], collector, stop=stop))
    daemon = asyncio.create_task(runner_mod.run(cfg, stop))
    return bus, stop, collector, [replay, daemon]


async def sandbox_gone(marker: str, bound_s: float = 15.0) -> bool:
    """True once no process mentions `marker`; a SIGKILLed sandbox's inner processes die
    asynchronously (pid-namespace teardown), so poll within a bound."""
    async def poll():
        while sandbox_processes(marker):
            await asyncio.sleep(0.05)
    try:
        await asyncio.wait_for(poll(), bound_s)
    except asyncio.TimeoutError:
        return False
    return True


def sandbox_processes(marker: str) -> list[int]:
    """Pids whose command line mentions `marker` (a per-execution home path)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if marker in cmd:
                pids.append(int(entry))
    return pids


async def test_runner_toy_harness_over_the_bus(nats_server, run_id, run_dir):
    def script(execution, n):
        if "hang" in execution:
            return "hang", None
        return "text", f"answer {n} from {execution}"

    fake = await FakeOpenAI(script, run_id).start()
    cfg = Config(run=run_id, nats_url=nats_server.url, nats_token=nats_server.token, run_dir=run_dir, tasks="toy",
                 key_secret=SECRET.hex(), proxy_url=fake.url, concurrency=3)
    bus, stop, collector, tasks = await start_runner(cfg, nats_server, run_id)
    try:
        await bus.publish(dispatched(run_id, "s0-g0-e0", "toy-count"))
        await bus.publish(dispatched(run_id, "s0-g0-hang", "toy-count", timeout_s=3.0))
        await bus.publish(dispatched(run_id, "s0-g0-e9", "no-such-task"))
        await collector.wait_finished(["s0-g0-e0", "s0-g0-hang", "s0-g0-e9"])

        ok = collector.finished["s0-g0-e0"]
        paths = Paths.of(run_dir, "s0-g0-e0")
        assert (ok.status, ok.exit_code, ok.workspace) == ("ok", 0, str(paths.workspace))
        assert ok.event_id == ids.finished(run_id, "s0-g0-e0")
        assert collector.started["s0-g0-e0"].workspace == str(paths.workspace)
        assert (paths.workspace / "answer.txt").read_text() == "answer 1 from s0-g0-e0"
        if ROOT:
            assert (paths.workspace / "answer.txt").stat().st_uid == cfg.sandbox.uid
        calls = [body for e, body in fake.requests if e == "s0-g0-e0"]
        assert len(calls) == 2
        first, second = calls[0]["messages"], calls[1]["messages"]
        assert second[: len(first)] == first  # the agent loop extends its own history
        assert second[len(first)] == {"role": "assistant", "content": "answer 0 from s0-g0-e0"}
        assert "toy_harness: call 1" in paths.log.read_text()
        assert not str(paths.log).startswith(str(paths.workspace))

        hung = collector.finished["s0-g0-hang"]
        assert hung.status == "timeout" and hung.exit_code is not None and hung.exit_code < 0
        assert hung.duration_s >= 3.0
        assert await sandbox_gone(str(Paths.of(run_dir, "s0-g0-hang").home))

        missing = collector.finished["s0-g0-e9"]
        assert (missing.status, missing.workspace, missing.exit_code) == ("no_workspace", "", None)
        assert "s0-g0-e9" not in collector.started

        # Stopping the runner kills a running harness and gives its message back unrecorded.
        await bus.publish(dispatched(run_id, "s0-g0-hang2", "toy-count", timeout_s=600.0))

        async def hang2_called():
            while not any(e == "s0-g0-hang2" for e, _ in fake.requests):
                await asyncio.sleep(0.05)
        await asyncio.wait_for(hang2_called(), 30)
    finally:
        stop.set()
        await asyncio.gather(*tasks)
        await bus.close()
    hang2 = Paths.of(run_dir, "s0-g0-hang2")
    assert await sandbox_gone(str(hang2.home)) and not hang2.record.exists()

    # A restarted runner: a redelivered finished execution is re-published (deduplicated),
    # never relaunched; a workspace without a record means a harness cut short by a restart.
    bus = await Bus.connect(nats_server.url, token=nats_server.token, run=run_id, name="test2")
    try:
        runner = Runner(cfg, bus, task_index(load_tasks("toy")))
        before = len(fake.requests)
        await runner.handle(dispatched(run_id, "s0-g0-e0", "toy-count"))
        assert len(fake.requests) == before
        await runner.handle(dispatched(run_id, "s0-g0-hang2", "toy-count"))
        record = schemas.decode("execution.finished", hang2.record.read_bytes())
        assert record.status == "harness_error" and len(fake.requests) == before
    finally:
        await bus.close()
        await fake.stop()


@pytest.mark.harness
async def test_mini_swe_agent_runs_confined_and_submits(nats_server, run_id, run_dir):
    def script(execution, n):
        if n == 0:
            return "tool", "printf 'made by mini' > made.txt && echo done"
        return "tool", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"

    fake = await FakeOpenAI(script, run_id).start()
    cfg = Config(run=run_id, nats_url=nats_server.url, nats_token=nats_server.token, run_dir=run_dir,
                 tasks="quickstart", key_secret=SECRET.hex(), proxy_url=fake.url, concurrency=1)
    bus, stop, collector, tasks = await start_runner(cfg, nats_server, run_id)
    try:
        await bus.publish(dispatched(run_id, "s0-g0-e0", "slugify", harness="mini-swe-agent", timeout_s=120.0,
                                     max_calls=5))
        await collector.wait_finished(["s0-g0-e0"], timeout_s=150.0)
        done = collector.finished["s0-g0-e0"]
        paths = Paths.of(run_dir, "s0-g0-e0")
        assert (done.status, done.exit_code) == ("ok", 0), paths.log.read_text()[-3000:]
        assert (paths.workspace / "made.txt").read_text() == "made by mini"
        traj = json.loads((paths.home / "traj.json").read_text())
        assert traj["info"]["exit_status"] == "Submitted"
        bodies = [body for _, body in fake.requests]
        assert len(bodies) == 2 and bodies[0]["model"] == "gyre"
        assert [t["function"]["name"] for t in bodies[0]["tools"]] == ["bash"]
        assert bodies[1]["messages"][: len(bodies[0]["messages"])] == bodies[0]["messages"]
    finally:
        stop.set()
        await asyncio.gather(*tasks)
        await bus.close()
        await fake.stop()


async def test_an_execution_is_launched_only_once_a_proxy_of_its_run_answers(nats_server, run_id, run_dir):
    """While the run's proxy restarts, `proxy.json` names a URL nothing answers at: the
    runner waits (reading the file again) instead of starting a harness that fails on a
    refused connection and is scored 0; another run's proxy does not count. With no
    proxy of the run within `proxy_wait_s` the launch fails (`harness_error`, excluded)."""
    import dataclasses

    import orjson

    from bus.server import free_port

    def script(execution, n):
        return "text", "unused"

    cfg = Config(run=run_id, nats_url=nats_server.url, nats_token=nats_server.token, run_dir=run_dir, tasks="toy",
                 key_secret=SECRET.hex(), proxy_wait_s=30.0)
    url_file = run_dir / "proxy.json"
    run_dir.mkdir(parents=True, exist_ok=True)
    url_file.write_bytes(orjson.dumps({"url": f"http://127.0.0.1:{free_port()}"}))
    other, ours = await FakeOpenAI(script, run_id + "x").start(), await FakeOpenAI(script, run_id).start()
    bus = await Bus.connect(nats_server.url, token=nats_server.token, run=run_id, name="test")
    try:
        waiting = asyncio.ensure_future(Runner(cfg, bus, task_index(load_tasks("toy")))._proxy_url())
        await asyncio.sleep(0.6)
        assert not waiting.done()
        url_file.write_bytes(orjson.dumps({"url": other.url}))
        await asyncio.sleep(0.6)
        assert not waiting.done()
        url_file.write_bytes(orjson.dumps({"url": ours.url}))
        assert await asyncio.wait_for(waiting, 10) == ours.url

        url_file.write_bytes(orjson.dumps({"url": other.url}))
        impatient = Runner(dataclasses.replace(cfg, proxy_wait_s=0.5), bus, task_index(load_tasks("toy")))
        with pytest.raises(RuntimeError, match=f"no proxy of run {run_id} answered at {other.url} within 0.5s"):
            await asyncio.wait_for(impatient._proxy_url(), 10)
    finally:
        await bus.close()
        await other.stop()
        await ours.stop()
