"""Each daemon starts on its own against an existing NATS (deployment shape) and stops
cleanly on SIGTERM with exit status 0; bad arguments exit 2."""
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import nats
import pytest

ROOT = Path(__file__).resolve().parents[1]


async def _consumer_exists(server, stream: str, durable: str) -> bool:
    nc = await nats.connect(server.url, token=server.token)
    try:
        await nc.jetstream().consumer_info(stream, durable)
        return True
    except Exception:  # noqa: BLE001 - not there yet
        return False
    finally:
        await nc.close()


@pytest.mark.parametrize("daemon,stream,durable,level", [
    ("builder", "CALLS", "builder-calls-v1", None),
    ("scheduler", "STEPS", "scheduler-steps-v2", None),
    ("builder", "CALLS", "builder-calls-v1", "warning"),
])
async def test_daemon_runs_against_existing_nats_and_stops_on_sigterm(nats_server, run_id, tmp_path, daemon, stream,
                                                                       durable, level):
    """... and `--log-level warning` leaves out its info lines."""
    env = dict(os.environ, GYRE_NATS_URL=nats_server.url, GYRE_NATS_TOKEN=nats_server.token,
               GYRE_RUNS_DIR=str(tmp_path))
    argv = [sys.executable, "-m", "handlers.cli", daemon, "--recipe", "toy", "--run", run_id]
    if level:
        argv += ["--log-level", level]
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stream_name = f"GYRE_{run_id.upper()}_{stream}"
    try:
        deadline = time.monotonic() + 60
        while not await _consumer_exists(nats_server, stream_name, durable):
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "daemon did not declare its consumer"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert ("daemon.stopped" in out) == (level is None), out


def test_daemon_without_nats_configuration_exits_2(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GYRE_NATS")}
    proc = subprocess.run([sys.executable, "-m", "handlers.cli", "builder", "--recipe", "toy", "--run", "x"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "GYRE_NATS_URL" in proc.stderr + proc.stdout


@pytest.mark.parametrize("daemon", ["proxy", "cell"])
def test_a_daemon_on_its_own_without_the_runs_model_names_the_command_that_writes_it(tmp_path, daemon):
    """With `model.dir` empty only `gyre run` writes the embedded default model into the
    run directory: a proxy or cell started on its own before it exists exits 2 with the
    `gyre init-model` line for the recipe's sizes (it crashed with a traceback)."""
    env = dict(os.environ, GYRE_NATS_URL="nats://127.0.0.1:1", GYRE_NATS_TOKEN="t", GYRE_KEY_SECRET="00" * 32,
               GYRE_RUNS_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "handlers.cli", daemon, "--recipe", "toy", "--run", "r1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert f"gyre init-model {tmp_path / 'r1' / 'model'} --layers 2 --hidden 64" in out, out
    assert "Traceback" not in out


def test_json_log_lines_never_raise():
    """The JSON renderer (orjson) writes what the stdlib encoder wrote for odd values, and
    falls back to the stdlib encoder for what orjson refuses."""
    import json

    import numpy as np

    from handlers.daemon import _json_line

    assert json.loads(_json_line({"event": "x", 3: "int key", "n": np.int32(7), "f": np.float64(0.5)})) == {
        "event": "x", "3": "int key", "n": 7, "f": 0.5}
    assert json.loads(_json_line({"big": 2**64})) == {"big": 2**64}
    assert _json_line({"lone": "\ud800"}) == '{"lone": "\\ud800"}'
    assert json.loads(_json_line({"p": Path("/x")}, default=repr)) == {"p": "PosixPath('/x')"}


def test_a_daemon_told_to_stop_while_the_bus_is_unreachable_stops_at_once(tmp_path):
    """NATS down (a closed port): the daemon keeps trying to connect (connect_timeout_s,
    30 s) until SIGTERM, then exits 0 at once; no traceback."""
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, GYRE_NATS_URL=f"nats://127.0.0.1:{port}", GYRE_NATS_TOKEN="t", GYRE_RUNS_DIR=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-m", "handlers.cli", "builder", "--recipe", "toy", "--run", "down"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(3.0)  # started and trying to connect
        assert proc.poll() is None, proc.stdout.read()
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and took < 5, (took, out)
    assert "daemon.stopped" in out and "Traceback" not in out and "daemon.crashed" not in out, out


def test_a_daemon_pointed_at_an_ended_run_says_so_at_once(tmp_path):
    """`--run-dir` of a run whose `gyre run` is gone: exit 2 with one line naming the
    ended run, not a 30 s connect timeout against its stopped NATS server."""
    import orjson

    from gyre.config import load_recipe

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    run_dir = tmp_path / "toy-ended"
    run_dir.mkdir()
    (run_dir / "config.json").write_bytes(orjson.dumps(load_recipe("toy").to_dict()))
    (run_dir / "nats.json").write_bytes(orjson.dumps({"run": "toy-ended", "url": "nats://127.0.0.1:1",
                                                      "pid": gone.pid}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("GYRE_NATS")}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "handlers.cli", "proxy", "--run-dir", str(run_dir)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    assert proc.returncode == 2 and took < 20, (took, proc.stderr)
    assert "run toy-ended has ended" in proc.stderr and "it wrote no summary" in proc.stderr, proc.stderr
    assert "daemon.run.ended" in proc.stderr, proc.stderr


async def test_a_daemon_joined_to_a_run_stops_when_the_run_ends(nats_server, run_id, tmp_path):
    """A daemon started on its own with `--run-dir` of a live run stops by itself once that
    run's `gyre run` is gone and its NATS server with it (it retried the dead server every
    second, forever, and a SIGTERM then ended in a traceback from closing the connection)."""
    import orjson

    from gyre.config import load_recipe
    from handlers.daemon import process_identity

    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        run_dir = tmp_path / run_id
        run_dir.mkdir()
        (run_dir / "config.json").write_bytes(orjson.dumps(load_recipe("toy").to_dict()))
        (run_dir / "nats.json").write_bytes(orjson.dumps({"run": run_id, "url": nats_server.url,
                                                          "token": nats_server.token,
                                                          **process_identity(owner.pid)}))
        env = {k: v for k, v in os.environ.items() if not k.startswith("GYRE_NATS")}
        proc = subprocess.Popen([sys.executable, "-m", "handlers.cli", "builder", "--run-dir", str(run_dir),
                                 "--log-json"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        try:
            deadline = time.monotonic() + 60
            while not await _consumer_exists(nats_server, f"GYRE_{run_id.upper()}_CALLS", "builder-calls-v1"):
                assert proc.poll() is None, proc.stdout.read()
                assert time.monotonic() < deadline, "daemon did not declare its consumer"
                time.sleep(0.2)
        finally:
            owner.kill()
            owner.wait()
        nats_server.stop()  # the run's private server ends with its `gyre run`
        out, _ = proc.communicate(timeout=60)
    finally:
        if owner.poll() is None:
            owner.kill()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "daemon.run.ended" in out and "daemon.stopped" in out, out
    assert "Traceback" not in out and "daemon.crashed" not in out, out


def test_run_owner_alive_tells_only_what_this_process_can_see():
    """An ended `gyre run` is one whose process is gone, exited but unreaped, or whose pid
    now names another process; from another host or pid namespace it cannot tell and
    says alive (a container sharing the run directory must not refuse a live run)."""
    from handlers.daemon import process_identity, run_owner_alive

    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    try:
        deadline = time.monotonic() + 20
        while Path(f"/proc/{zombie.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline, "the child did not exit"
            time.sleep(0.05)
        me = process_identity(live.pid)
        assert {"pid", "host", "pid_ns", "started"} <= set(me)
        assert run_owner_alive(me)
        assert run_owner_alive({"pid": live.pid})  # an older nats.json: the pid alone
        assert not run_owner_alive({**me, "started": me["started"] - 1})  # the pid was reused
        assert not run_owner_alive(process_identity(zombie.pid))
        assert not run_owner_alive({**me, "pid": gone.pid})
        assert run_owner_alive({**me, "pid": gone.pid, "host": me["host"] + "-elsewhere"})
        assert run_owner_alive({**me, "pid": gone.pid, "pid_ns": "pid:[1]"})
        assert run_owner_alive({"run": "r"})
    finally:
        live.kill()
        live.wait()
        zombie.wait()


async def test_a_server_lost_while_declaring_streams_after_stop_is_a_clean_stop(nats_server, run_id, monkeypatch):
    """`connected` declares the run's streams and consumers one by one; when the run ends
    meanwhile (its server goes away and the daemon's `stop` is set), the failed declaration
    is a stop (ConnectError(stopped=True): main exits 0), not a crash."""
    import asyncio
    import types

    from bus import Bus, ConnectError
    from handlers.daemon import connected

    stop = asyncio.Event()
    declare = Bus.ensure_streams

    async def the_run_ends_midway(self):
        stop.set()
        nats_server.stop()
        await declare(self)

    monkeypatch.setattr(Bus, "ensure_streams", the_run_ends_midway)
    cfg = types.SimpleNamespace(run=run_id, nats_url=nats_server.url, nats_token=nats_server.token)
    with pytest.raises(ConnectError) as caught:
        async with connected(cfg, stop, "builder"):
            pytest.fail("the streams were declared against a stopped server")
    assert caught.value.stopped
