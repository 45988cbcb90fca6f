"""`gyre tap` as a person runs it: against a live run's directory it prints each event as
one readable line and stops by itself when the run ends; an ended run is refused at once."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import orjson

import schemas
from bus import Bus

ROOT = Path(__file__).resolve().parents[1]


def _run_dir(tmp_path: Path, run: str, url: str, token: str | None, pid: int) -> Path:
    run_dir = tmp_path / run
    run_dir.mkdir()
    info = {"run": run, "url": url, "pid": pid}
    if token:
        info["token"] = token
    (run_dir / "nats.json").write_bytes(orjson.dumps(info))
    return run_dir


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("GYRE_NATS")}


async def test_tap_prints_a_live_runs_events_and_stops_when_the_run_ends(nats_server, run_id, tmp_path):
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # stands in for `gyre run`
    run_dir = _run_dir(tmp_path, run_id, nats_server.url, nats_server.token, owner.pid)
    tap = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "handlers.cli", "tap", "--run-dir", str(run_dir), "cell.*", cwd=ROOT, env=_env(),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    bus = await Bus.connect(nats_server.url, token=nats_server.token, run=run_id, name="test-tap")
    try:
        await bus.ensure_streams()
        line, deadline = b"", time.monotonic() + 60
        while not line and time.monotonic() < deadline and tap.returncode is None:
            # the tap subscribes some time after it starts: publish until it shows one
            await bus.publish(schemas.CellSwitch(event_id=f"{run_id}:sw:{time.monotonic()}", cell="cell7", seq=3,
                                                 from_role="idle", to_role="rollout", reason="tap test"))
            try:
                line = await asyncio.wait_for(tap.stdout.readline(), 0.5)
            except asyncio.TimeoutError:
                pass
        text = line.decode()
        assert text.split()[1:2] == ["cell.switch"], text
        assert "cell=cell7" in text and "to_role=rollout" in text and "event_id" not in text, text
        owner.kill()
        owner.wait()
        _, err = await asyncio.wait_for(tap.communicate(), 30)  # stops by itself about 1 s after the run ends
        assert tap.returncode == 0, err
        assert b"the run has ended" in err, err
    finally:
        await bus.close()
        if owner.poll() is None:
            owner.kill()
        if tap.returncode is None:
            tap.kill()
            await tap.wait()


async def test_tap_stops_quietly_when_its_reader_goes_away(nats_server, run_id, tmp_path):
    """`gyre tap | head -1`: once the pipe's reader is gone the tap exits 0 with no traceback
    (it wrote a BrokenPipeError traceback per event, forever)."""
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    run_dir = _run_dir(tmp_path, run_id, nats_server.url, nats_server.token, owner.pid)
    read, write = os.pipe()
    tap = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "handlers.cli", "tap", "--run-dir", str(run_dir), "cell.*", cwd=ROOT, env=_env(),
        stdout=write, stderr=asyncio.subprocess.PIPE)
    os.close(write)
    bus = await Bus.connect(nats_server.url, token=nats_server.token, run=run_id, name="test-tap")
    try:
        await bus.ensure_streams()
        deadline = time.monotonic() + 60
        with os.fdopen(read, "rb", buffering=0) as reader:
            os.set_blocking(reader.fileno(), False)
            first = None
            while not first and time.monotonic() < deadline:
                await bus.publish(schemas.CellSwitch(event_id=f"{run_id}:sw:{time.monotonic()}", cell="c1", seq=1,
                                                     from_role="idle", to_role="rollout", reason="x"))
                await asyncio.sleep(0.3)
                first = reader.read(4096)
        assert first, "the tap printed nothing"
        for k in range(5):  # the reader is gone: these hit a broken pipe
            await bus.publish(schemas.CellSwitch(event_id=f"{run_id}:late:{k}", cell="c1", seq=2,
                                                 from_role="idle", to_role="rollout", reason="x"))
        _, err = await asyncio.wait_for(tap.communicate(), 30)
        assert tap.returncode == 0 and b"Traceback" not in err and b"BrokenPipe" not in err, err
    finally:
        await bus.close()
        owner.kill()
        owner.wait()
        if tap.returncode is None:
            tap.kill()
            await tap.wait()


def test_tap_refuses_an_ended_run_at_once(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    run_dir = _run_dir(tmp_path, "ended", "nats://127.0.0.1:1", None, gone.pid)
    (run_dir / "summary.json").write_text("{}")
    proc = subprocess.run([sys.executable, "-m", "handlers.cli", "tap", "--run-dir", str(run_dir)],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "run ended has ended" in proc.stderr and "summary.json" in proc.stderr, proc.stderr


def test_tap_whose_runs_server_does_not_answer_says_why(tmp_path):
    """The run's own nats-server refusing the connection: while the run's `gyre run` lives,
    tap says the run may be ending; once it is gone by the time the connect gives up, that
    the run has ended, as when it was gone from the start."""
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for n, lives in enumerate((True, False)):
        owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            run_dir = _run_dir(tmp_path, f"ending{n}", f"nats://127.0.0.1:{port}", None, owner.pid)
            tap = subprocess.Popen([sys.executable, "-m", "handlers.cli", "tap", "--run-dir", str(run_dir)],
                                   cwd=ROOT, env=_env(), stderr=subprocess.PIPE, text=True)
            if not lives:
                time.sleep(1.0)  # tap is connecting by now
                owner.kill()
                owner.wait()
            err = tap.communicate(timeout=60)[1]
        finally:
            owner.kill()
            owner.wait()
        assert "Traceback" not in err, err
        if lives:
            assert tap.returncode == 1 and "could not connect" in err and "the run may be ending" in err, err
        else:  # 2 when tap was slower to start than the owner to go (it then sees it gone before connecting)
            assert tap.returncode in (1, 2) and f"run ending{n} has ended" in err, err


def test_tap_run_names_a_run_directory_under_the_runs_root(tmp_path):
    """`gyre tap --run ID` (no GYRE_NATS_URL) taps runs/ID, not runs/latest's run."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    _run_dir(tmp_path, "older", "nats://127.0.0.1:1", None, gone.pid)
    latest = _run_dir(tmp_path, "newer", "nats://127.0.0.1:1", None, gone.pid)
    (tmp_path / "latest").symlink_to(latest)
    env = dict(_env(), GYRE_RUNS_DIR=str(tmp_path))
    for args, named in ((["--run", "older"], "older"), ([], "newer")):
        proc = subprocess.run([sys.executable, "-m", "handlers.cli", "tap", *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and f"run {named} has ended" in proc.stderr, proc.stderr
    proc = subprocess.run([sys.executable, "-m", "handlers.cli", "tap", "--run", "nosuch"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "nosuch/nats.json not found" in proc.stderr, proc.stderr


def test_tap_says_in_one_line_when_the_bus_is_unreachable():
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(_env(), GYRE_NATS_URL=f"nats://127.0.0.1:{port}")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "handlers.cli", "tap", "--run", "x"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    assert proc.returncode == 1 and took < 30, (took, proc.stderr)
    assert f"gyre tap: could not connect to nats://127.0.0.1:{port}" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


def test_tap_against_a_deployments_server_needs_the_run_named():
    """With GYRE_NATS_URL set there is no "current run": a bare `gyre tap` tapped every run
    on the server while its help and the README promised the current run's events."""
    env = dict(_env(), GYRE_NATS_URL="nats://127.0.0.1:1")
    proc = subprocess.run([sys.executable, "-m", "handlers.cli", "tap"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--run ID (or --all-runs)" in proc.stderr, proc.stderr


async def test_a_pattern_that_is_a_whole_subject_names_its_run_against_a_deployments_server(nats_server, run_id):
    """`GYRE_NATS_URL=... gyre tap 'gyre.v1.RUN.cell.*'`: the subject names the run, so no
    --run is asked for, and only that run's events are shown."""
    env = dict(_env(), GYRE_NATS_URL=nats_server.url, GYRE_NATS_TOKEN=nats_server.token)
    tap = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "handlers.cli", "tap", f"gyre.v1.{run_id}.cell.*", cwd=ROOT, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    ours = await Bus.connect(nats_server.url, token=nats_server.token, run=run_id, name="test-tap")
    other = await Bus.connect(nats_server.url, token=nats_server.token, run=f"{run_id}-other", name="test-tap")
    try:
        await ours.ensure_streams()
        await other.ensure_streams()
        line, deadline = b"", time.monotonic() + 60
        while not line and time.monotonic() < deadline and tap.returncode is None:
            for bus, cell in ((other, "cell-other"), (ours, "cell-ours")):
                await bus.publish(schemas.CellSwitch(event_id=f"{bus.run}:sw:{time.monotonic()}", cell=cell, seq=1,
                                                     from_role="idle", to_role="rollout", reason="tap test"))
            try:
                line = await asyncio.wait_for(tap.stdout.readline(), 0.5)
            except asyncio.TimeoutError:
                pass
        assert "cell=cell-ours" in line.decode(), (line, tap.returncode)
    finally:
        await ours.close()
        await other.close()
        if tap.returncode is None:
            tap.terminate()
        _, err = await asyncio.wait_for(tap.communicate(), 30)
    assert b"--run" not in err, err
    assert b"cell-other" not in _, _


def test_a_call_events_line_gives_its_token_arrays_lengths_and_its_sampling():
    from handlers.tap import summarise

    event = {"emitted_at": "2026-12-03T14:00:00.123456Z", "call": "ex:3", "execution": "ex",
             "tokens": {"prompt_ids": list(range(500)), "completion_ids": [1] * 48, "logprobs": [-0.5] * 48},
             "sampling": {"temperature": 0.7, "top_p": 1.0, "top_k": -1, "max_tokens": 16384, "stop": ["END"]},
             "meta": {"session": "s" * 300}, "status": "aborted", "finish_reason": "stop"}
    line = summarise("gyre.v1.r.call.completed", orjson.dumps(event), width=400)
    assert "tokens=prompt_ids<500> completion_ids<48> logprobs<48>" in line, line
    assert '"max_tokens":16384,"stop":["END"]}' in line, line  # a value is never cut inside
    short = summarise("gyre.v1.r.call.completed", orjson.dumps(event), width=100)
    assert "call=ex:3 status=aborted finish_reason=stop" in short, short  # the outcome survives a narrow width
