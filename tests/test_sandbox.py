"""Confinement: unprivileged uid, private view of the file system, a private network namespace
that reaches only the proxy's relay, clean env, and a readable interpreter or a clear refusal."""
from __future__ import annotations

import asyncio
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
    Network,
    SandboxConfig,
    SandboxError,
    _ancestors,
    base_env,
    check_env,
    confine,
    own_tree,
    resolve_mode,
    unreachable_ancestor,
    unreadable,
)
from handlers import sandbox_relay

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
def connect(port):
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"ping")
        assert s.recv(4) == b"pong"
out["loopback"] = attempt(lambda: connect(int(sys.argv[3])))
if len(sys.argv) > 4:  # the proxy's port, relayed
    out["proxy"] = attempt(lambda: connect(int(sys.argv[4])))
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


@pytest.fixture(scope="module")
def pythons():
    """(readable, private): the same interpreter as a venv in a directory the sandbox uid may
    traverse, and as a venv of a fresh checkout in a private (0700) directory, as `mktemp
    -d` makes it and as home directories are on current Debian. Independent of where this
    checkout itself lives."""
    base = Path(tempfile.mkdtemp(prefix="gyre-pythons-"))
    out = []
    for name, mode in (("readable", 0o711), ("private", 0o700)):
        (base / name).mkdir()
        os.chmod(base / name, mode)
        subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(base / name / ".venv")], check=True)
        out.append(str(base / name / ".venv" / "bin" / "python"))
    os.chmod(base, 0o711)
    yield tuple(out)
    shutil.rmtree(base, ignore_errors=True)


def run_probe(layout: Path, port: int, mode: str, python: str, proxy_port: int | None = None,
              network: Network | None = None) -> dict:
    ws = layout / "workspaces" / "e1"
    cfg = SandboxConfig(mode=mode, readonly=python_installation(python))
    env = base_env(home=str(ws), extra={"GYRE_EXAMPLE": "1"})
    argv = [python, "-c", PROBE, str(layout / "nats.json"), str(layout / "workspaces" / "e2" / "other.txt"), str(port)]
    launch = confine(argv + ([str(proxy_port)] if proxy_port else []), cwd=ws, env=env, cfg=cfg, network=network)
    os.environ["GYRE_SANDBOX_TEST_LEAK"] = "leak"
    try:
        res = subprocess.run(launch.argv, capture_output=True, text=True, timeout=60, **launch.popen_kwargs())
    finally:
        del os.environ["GYRE_SANDBOX_TEST_LEAK"]
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


@pytest.mark.skipif(not (ROOT and HAS_BWRAP), reason="needs root and a working bubblewrap")
def test_bwrap_confines_to_own_workspace(layout, listener, pythons):
    """Also from a checkout inside a 0700 directory: bubblewrap binds its installation."""
    out = run_probe(layout, listener, "bwrap", pythons[1])
    assert (out["uid"], out["gid"], out["groups"]) == (UID, UID, [])
    assert set(out["caps"].values()) == {0}, out["caps"]
    assert out["cwd"] == str(layout / "workspaces" / "e1")
    assert out["read_secret"] == "FileNotFoundError"  # the run directory is not even visible
    assert out["read_other_ws"] == "FileNotFoundError"
    assert out["list_root"] == "FileNotFoundError"
    assert out["write_ws"] == "ok"
    assert out["write_usr"] in ("OSError", "PermissionError")  # read-only system
    assert out["loopback"] == "ConnectionRefusedError"  # its own network namespace: the host's loopback is not there
    assert "GYRE_SANDBOX_TEST_LEAK" not in out["env"] and "GYRE_EXAMPLE" in out["env"]
    written = layout / "workspaces" / "e1" / "written.txt"
    assert written.read_text() == "hi" and written.stat().st_uid == UID


@pytest.mark.skipif(not ROOT, reason="the setuid fallback needs root")
def test_setuid_fallback_drops_privileges(layout, listener, pythons):
    out = run_probe(layout, listener, "setuid", pythons[0])
    assert (out["uid"], out["gid"], out["groups"]) == (UID, UID, [])
    assert out["read_secret"] == "PermissionError"
    assert out["read_other_ws"] == "PermissionError"
    assert out["list_root"] == "PermissionError"
    assert set(out["caps"].values()) == {0}, out["caps"]
    assert out["write_ws"] == "ok"
    assert out["loopback"] == "OSError"  # no Network given: a namespace of its own, loopback down (unreachable)
    assert "GYRE_SANDBOX_TEST_LEAK" not in out["env"]


@pytest.mark.skipif(not ROOT, reason="the setuid fallback needs root")
def test_setuid_fallback_refuses_an_interpreter_its_uid_cannot_read(layout, pythons):
    """A checkout in a 0700 directory: its venv's interpreter is unreachable for the sandbox
    uid, so the launch is refused before anything starts, naming the directory in the way and
    the fix (instead of a PermissionError on exec inside the harness)."""
    private_dir = str(Path(pythons[1]).parents[2])
    with pytest.raises(SandboxError) as err:
        run_probe(layout, 1, "setuid", pythons[1])
    message = str(err.value)
    assert message.startswith(f"{pythons[1]} is not readable by the sandbox uid {UID}: {private_dir} is not searchable")
    assert f"chmod o+x {private_dir}" in message and "apt-get install bubblewrap" in message
    assert unreadable([pythons[0]], UID, UID) == ""


@pytest.mark.skipif(not ROOT, reason="the sandbox uid differs from gyre's only as root")
def test_unreadable_names_the_first_path_in_the_way(sandbox_dir):
    tmp_path = sandbox_dir
    inst = tmp_path / "inst"
    (inst / "bin").mkdir(parents=True)
    exe = inst / "bin" / "tool"
    exe.write_text("#!/bin/sh\n")
    os.chmod(tmp_path, 0o711)
    os.chmod(inst, 0o755)
    os.chmod(exe, 0o700)  # installed under umask 077
    problem = unreadable([exe], UID, UID, binds=[str(inst)])
    assert problem.startswith(f"{exe} is not readable by the sandbox uid {UID}: it is not readable (mode 0700)")
    assert f"chmod -R o+rX {exe}" in problem
    os.chmod(exe, 0o755)
    assert unreadable([exe], UID, UID, binds=[str(inst)]) == ""
    os.chmod(inst / "bin", 0o700)
    assert f"{inst / 'bin'} is not searchable" in unreadable([exe], UID, UID, binds=[str(inst)])
    assert "does not exist" in unreadable([inst / "missing"], UID, UID)
    os.chmod(inst / "bin", 0o755)
    os.chmod(tmp_path, 0o700)  # above the bind: bubblewrap makes its own ancestors, setuid needs them
    assert unreadable([exe], UID, UID, binds=[str(inst)]) == ""
    assert f"{tmp_path} is not searchable" in unreadable([exe], UID, UID)
    os.chmod(tmp_path, 0o711)


@pytest.fixture
async def proxy_relay(listener):
    """A stand-in proxy (echo 'ping' → 'pong' on a loopback port) behind the runner's relay."""
    echo = socket.socket()
    echo.bind(("127.0.0.1", 0))
    echo.listen()

    def serve():
        while True:
            try:
                conn, _ = echo.accept()
            except OSError:
                return
            with conn:
                if conn.recv(4) == b"ping":
                    conn.sendall(b"pong")

    threading.Thread(target=serve, daemon=True).start()
    sock_dir = tempfile.mkdtemp(prefix="gyre-relay-test-")
    os.chmod(sock_dir, 0o711)
    relay = sandbox_relay.ProxyRelay(os.path.join(sock_dir, "proxy.sock"), lambda: ("127.0.0.1", port),
                                     owner=(UID, UID) if ROOT else None)
    port = echo.getsockname()[1]
    await relay.start()
    yield relay, port
    await relay.close()
    echo.close()
    shutil.rmtree(sock_dir, ignore_errors=True)


def relay_network(relay, port: int) -> Network:
    script = os.path.abspath(sandbox_relay.__file__)
    return Network(port=port, socket=relay.path, relay=(sys.executable, "-I", "-S", script),
                   readonly=(*python_installation(sys.executable), script))


@pytest.mark.parametrize("mode", ["bwrap", "setuid"])
async def test_with_a_network_only_the_proxy_port_is_reachable(layout, listener, pythons, proxy_relay, mode):
    """The process finds the proxy at its own port on 127.0.0.1 (relayed through the runner's
    socket) and nothing else of the host's loopback, in both modes that confine."""
    if not ROOT or (mode == "bwrap" and not HAS_BWRAP):
        pytest.skip("needs root (and bubblewrap for its mode)")
    relay, port = proxy_relay
    out = await asyncio.to_thread(run_probe, layout, listener, mode, pythons[0], port, relay_network(relay, port))
    assert out["proxy"] == "ok" and relay.connections == 1
    assert out["loopback"] == "ConnectionRefusedError"
    assert (out["uid"], out["gid"], out["groups"]) == (UID, UID, [])
    assert set(out["caps"].values()) == {0}, out["caps"]


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
    assert "--unshare-net" in argv  # the host's loopback stays outside
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


@pytest.mark.skipif(not ROOT, reason="the sandbox uid differs from gyre's only as root")
def test_the_runner_stops_at_start_when_the_sandbox_uid_cannot_read_its_harness_interpreter(pythons, sandbox_dir):
    """A fresh checkout in a 0700 directory under the setuid fallback: the runner refuses to
    start, naming the path and the fix; under bubblewrap, which binds it, it starts."""
    import dataclasses

    from handlers.daemon import FatalError
    from handlers.runner import Config, Runner

    cfg = Config(run="r", nats_url="nats://127.0.0.1:1", nats_token=None, run_dir=sandbox_dir / "run", tasks="toy",
                 key_secret="ab", python=pythons[1], sandbox=SandboxConfig(mode="setuid"))
    with pytest.raises(FatalError) as err:
        Runner(cfg, None, {})
    assert f"{pythons[1]} is not readable by the sandbox uid {UID}: {Path(pythons[1]).parents[2]} is not searchable" \
        in str(err.value)
    Runner(dataclasses.replace(cfg, python=pythons[0]), None, {})
    if HAS_BWRAP:
        Runner(dataclasses.replace(cfg, sandbox=SandboxConfig(mode="bwrap")), None, {})


NO_SYS_ADMIN = [shutil.which("setpriv") or "/usr/bin/setpriv", "--bounding-set=-sys_admin", "--"]


@pytest.mark.skipif(not ROOT, reason="the setuid fallback needs root")
@pytest.mark.parametrize("mode", ["setuid", "auto"])
def test_a_root_without_cap_sys_admin_is_refused_with_the_fix(mode):
    """A root container without CAP_SYS_ADMIN (Docker's default) can make no network
    namespace: the setuid fallback could not confine a harness, so resolving the mode fails
    naming the fix, instead of every harness dying in its relay (exit 125)."""
    code = ("from gyre.env.sandbox import SandboxConfig, resolve_mode\n"
            f"print(resolve_mode(SandboxConfig(mode={mode!r}, bwrap='/nonexistent/bwrap')))")
    res = subprocess.run([*NO_SYS_ADMIN, sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[1])
    assert res.returncode != 0, res.stdout
    assert "RuntimeError" in res.stderr and "network namespace" in res.stderr and "CAP_SYS_ADMIN" in res.stderr


@pytest.mark.skipif(not ROOT, reason="the setuid fallback needs root")
def test_the_runner_stops_at_start_where_harnesses_cannot_be_confined(tmp_path):
    code = ("import asyncio\n"
            "from gyre.env.sandbox import SandboxConfig\n"
            "from handlers.daemon import FatalError\n"
            "from handlers.runner import Config, Runner\n"
            f"cfg = Config(run='r1', nats_url='nats://127.0.0.1:1', nats_token=None, run_dir={str(tmp_path)!r},\n"
            "             key_secret='00' * 32, tasks='toy', sandbox=SandboxConfig(mode='auto', bwrap='/nonexistent'))\n"
            "try:\n"
            "    Runner(cfg, None, {})\n"
            "except FatalError as exc:\n"
            "    print('FATAL', exc)\n")
    res = subprocess.run([*NO_SYS_ADMIN, sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[1])
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("FATAL cannot confine harnesses here") and "CAP_SYS_ADMIN" in res.stdout


def test_a_relay_that_cannot_set_up_makes_the_execution_a_harness_error():
    from handlers import sandbox_relay
    from handlers.runner import harness_status

    script = Path(sandbox_relay.__file__)
    res = subprocess.run([sys.executable, "-I", "-S", str(script), "--listen", "127.0.0.1:notaport", "--socket",
                          "/nonexistent.sock", "--", "/bin/true"], capture_output=True, text=True, timeout=30)
    assert res.returncode == sandbox_relay.FAILED, res.stderr
    assert "cannot set up the sandbox's network" in res.stderr
    assert harness_status("ok", "bwrap", res.returncode) == "harness_error"
    assert harness_status("ok", "setuid", res.returncode) == "harness_error"
    assert harness_status("ok", "none", res.returncode) == "ok"  # no relay in mode none: the harness's own code
    assert harness_status("ok", "bwrap", 1) == "ok" and harness_status("timeout", "bwrap", None) == "timeout"
