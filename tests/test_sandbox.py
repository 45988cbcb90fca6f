"""Confinement: unprivileged uid, private view of the file system, loopback, clean env."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from gyre.env.harness import python_installation
from gyre.env.sandbox import (
    SandboxConfig,
    _ancestors,
    base_env,
    check_env,
    confine,
    own_tree,
    resolve_mode,
    unreachable_ancestor,
)

ROOT = os.geteuid() == 0
HAS_BWRAP = shutil.which("bwrap") is not None and resolve_mode(SandboxConfig())[0] == "bwrap"
UID = 65534

PROBE = r"""
import json, os, socket, sys
out = {"uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(), "cwd": os.getcwd(),
       "env": sorted(os.environ)}
out["caps"] = {line.split(":")[0]: int(line.split()[1], 16) for line in open("/proc/self/status")
               if line.startswith("Cap")}
def attempt(fn):
    try:
        fn()
        return "ok"
    except OSError as exc:
        return type(exc).__name__
out["read_secret"] = attempt(lambda: open(sys.argv[1]).read())
out["list_root"] = attempt(lambda: os.listdir("/root"))
out["read_other_ws"] = attempt(lambda: open(sys.argv[2]).read())
out["write_ws"] = attempt(lambda: open("written.txt", "w").write("hi"))
out["write_usr"] = attempt(lambda: open("/usr/gyre-probe", "w").write("x"))
def connect():
    with socket.create_connection(("127.0.0.1", int(sys.argv[3])), timeout=5) as s:
        s.sendall(b"ping")
        assert s.recv(4) == b"pong"
out["loopback"] = attempt(connect)
print(json.dumps(out))
"""


@pytest.fixture
def layout():
    """A run directory like gyre's: private (0700) with nats.json and two workspaces."""
    base = Path(tempfile.mkdtemp(prefix="gyre-sbx-"))
    os.chmod(base, 0o711)  # the setuid fallback needs traversable ancestors
    run = base / "run"
    (run / "workspaces" / "e1").mkdir(parents=True)
    (run / "workspaces" / "e2").mkdir(parents=True)
    os.chmod(run, 0o711)
    os.chmod(run / "workspaces", 0o711)
    secret = run / "nats.json"
    secret.write_text('{"token": "s3cret"}')
    os.chmod(secret, 0o600)
    (run / "workspaces" / "e2" / "other.txt").write_text("other")
    os.chmod(run / "workspaces" / "e2", 0o700)
    own_tree(run / "workspaces" / "e1", UID, UID)
    yield run
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def listener():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()

    def serve():
        try:
            conn, _ = srv.accept()
        except OSError:
            return
        with conn:
            if conn.recv(4) == b"ping":
                conn.sendall(b"pong")

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield srv.getsockname()[1]
    srv.close()


def run_probe(layout: Path, port: int, mode: str) -> dict:
    ws = layout / "workspaces" / "e1"
    cfg = SandboxConfig(mode=mode, readonly=python_installation(sys.executable))
    env = base_env(home=str(ws), extra={"GYRE_EXAMPLE": "1"})
    launch = confine([sys.executable, "-c", PROBE, str(layout / "nats.json"),
                      str(layout / "workspaces" / "e2" / "other.txt"), str(port)], cwd=ws, env=env, cfg=cfg)
    os.environ["GYRE_SANDBOX_TEST_LEAK"] = "leak"
    try:
        res = subprocess.run(launch.argv, capture_output=True, text=True, timeout=60, **launch.popen_kwargs())
    finally:
        del os.environ["GYRE_SANDBOX_TEST_LEAK"]
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


@pytest.mark.skipif(not (ROOT and HAS_BWRAP), reason="needs root and a working bubblewrap")
def test_bwrap_confines_to_own_workspace(layout, listener):
    out = run_probe(layout, listener, "bwrap")
    assert (out["uid"], out["gid"], out["groups"]) == (UID, UID, [])
    assert set(out["caps"].values()) == {0}, out["caps"]
    assert out["cwd"] == str(layout / "workspaces" / "e1")
    assert out["read_secret"] == "FileNotFoundError"  # the run directory is not even visible
    assert out["read_other_ws"] == "FileNotFoundError"
    assert out["list_root"] == "FileNotFoundError"
    assert out["write_ws"] == "ok"
    assert out["write_usr"] in ("OSError", "PermissionError")  # read-only system
    assert out["loopback"] == "ok"
    assert "GYRE_SANDBOX_TEST_LEAK" not in out["env"] and "GYRE_EXAMPLE" in out["env"]
    written = layout / "workspaces" / "e1" / "written.txt"
    assert written.read_text() == "hi" and written.stat().st_uid == UID


@pytest.mark.skipif(not ROOT, reason="the setuid fallback needs root")
def test_setuid_fallback_drops_privileges(layout, listener):
    out = run_probe(layout, listener, "setuid")
    assert (out["uid"], out["gid"], out["groups"]) == (UID, UID, [])
    assert out["read_secret"] == "PermissionError"
    assert out["read_other_ws"] == "PermissionError"
    assert out["list_root"] == "PermissionError"
    assert out["write_ws"] == "ok" and out["loopback"] == "ok"
    assert "GYRE_SANDBOX_TEST_LEAK" not in out["env"]


def test_nats_settings_never_pass():
    for key in ("GYRE_NATS_TOKEN", "GYRE_NATS_URL", "NATS_TOKEN", "nats_url"):
        with pytest.raises(ValueError, match=key):
            check_env({"PATH": "/usr/bin", key: "x"})
    with pytest.raises(ValueError, match="GYRE_NATS_TOKEN"):
        confine(["true"], cwd="/tmp", env={"GYRE_NATS_TOKEN": "t"}, cfg=SandboxConfig(mode="none"))


def test_config_validation():
    with pytest.raises(ValueError, match="mode"):
        SandboxConfig(mode="docker")
    with pytest.raises(ValueError, match="unprivileged"):
        SandboxConfig(uid=0)
    with pytest.raises(ValueError, match="absolute"):
        SandboxConfig(readonly=("rel/path",))


def test_base_env_is_minimal():
    env = base_env(home="/h", path_dirs=["/venv/bin"], extra={"OPENAI_API_KEY": "k"})
    assert env["PATH"].startswith("/venv/bin:") and env["HOME"] == "/h" and env["OPENAI_API_KEY"] == "k"
    assert set(env) == {"PATH", "HOME", "TMPDIR", "LANG", "LC_ALL", "TERM", "PYTHONUNBUFFERED", "OPENAI_API_KEY"}


@pytest.mark.skipif(not (ROOT and HAS_BWRAP), reason="needs root and a working bubblewrap")
def test_bwrap_argv_creates_traversable_parents_once():
    launch = confine(["true"], cwd="/srv/runs/r1/workspaces/e1", env={}, cfg=SandboxConfig(),
                     writable=["/srv/runs/r1/homes/e1"], readonly=["/opt/venv"])
    argv = launch.argv
    dirs = [argv[i + 1] for i, a in enumerate(argv) if a == "--dir"]
    assert sorted(dirs) == ["/opt", "/srv", "/srv/runs", "/srv/runs/r1", "/srv/runs/r1/homes", "/srv/runs/r1/workspaces"]
    assert dirs.index("/srv") < dirs.index("/srv/runs") < dirs.index("/srv/runs/r1")  # parents first
    sep = argv.index("--")
    assert argv[sep + 1].endswith("setpriv") and f"--reuid={UID}" in argv and argv[-1] == "true"
    assert "--unshare-net" not in argv  # loopback must reach the proxy
    assert _ancestors("/a/b/c") == ["/a", "/a/b"]


def test_unreachable_ancestor(tmp_path):
    d = tmp_path / "x" / "y"
    d.mkdir(parents=True)
    os.chmod(tmp_path / "x", 0o700)
    assert unreachable_ancestor(d, UID, UID) is not None
    os.chmod(tmp_path / "x", 0o711)
    blocked = unreachable_ancestor(d, UID, UID)
    assert blocked is None or not str(d).startswith(blocked + "/x")


def test_private_tmp_is_writable_by_the_unprivileged_uid(tmp_path):
    """Harnesses (Claude Code) write to /tmp; the sandbox's private /tmp must allow it."""
    import subprocess

    from gyre.env.sandbox import SandboxConfig, base_env, confine, own_tree, resolve_mode

    cfg = SandboxConfig()
    mode, _warning = resolve_mode(cfg)
    if mode != "bwrap":
        import pytest
        pytest.skip("bubblewrap not available")
    ws = tmp_path / "ws"
    ws.mkdir()
    own_tree(ws, cfg.uid, cfg.gid)
    launch = confine(["/bin/sh", "-c", "echo hi > /tmp/probe && cat /tmp/probe && id -u"], cwd=ws,
                     env=base_env(home=str(ws)), cfg=cfg)
    out = subprocess.run(launch.argv, cwd=str(ws), env=launch.env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["hi", str(cfg.uid)]
