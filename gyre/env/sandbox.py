"""Confinement of harness and grading processes (DESIGN.md "Processes": runner).

A harness executes whatever the policy writes, so each process runs:
- under an unprivileged uid (default 65534 `nobody`) even when gyre runs as root;
- with an explicit allow-listed environment: never the run's secrets (`check_env`: the
  NATS url and token, the engine token, the key secret);
- with bubblewrap where available: read-only system (/usr, /etc, /bin, /lib*), read-only
  extra paths (the venv or harness installation), read-write only its own directories
  (workspace, per-execution home), a private /tmp, fresh /proc and /dev, its own pid, ipc,
  uts, cgroup and network namespaces. Nothing else of the host is visible: no other
  workspace, no run directory (nats.json), no /root.

Network (`Network`, given by the runner for a harness): the process gets a private network
namespace whose only interface is its own loopback, on which one listener, 127.0.0.1:PORT
(the proxy's port), relays each connection to a Unix socket outside, the runner's relay to
the proxy (`handlers/sandbox_relay.py` runs inside, the harness is its child). So a harness
reaches the proxy at its usual URL and nothing else: not the engines, NATS, metrics or any
other listener on the host's loopback, no abstract Unix socket of the host (those belong to
a network namespace), no other host or the internet. Without a `Network` (graders) the
namespace has only its loopback. The `none` mode has no namespace (the host's network).

Readability (`unreadable`): the sandbox uid must be able to read the interpreter and the
installation a process runs from. `confine` checks the command and the read-only paths
before anything starts and raises `SandboxError` naming the first path that uid cannot read
and the fix (bubblewrap binds the installation, so there only the bound tree's own modes
count; the setuid fallback needs every ancestor searchable too, which a checkout in a 0700
home or `mktemp -d` directory is not).

Modes (`resolve_mode`):
- `bwrap`, gyre is root: bwrap runs without a user namespace (root does the mounts) with
  CAP_SETUID/CAP_SETGID/CAP_SETPCAP kept, and `setpriv` inside drops to uid:gid with no
  groups and empty capability sets (bounding set included). Works where unprivileged user
  namespaces are disabled.
- `bwrap`, gyre is not root: bwrap in a user namespace; the process keeps gyre's uid.
- `setuid` (no bwrap, root): the process runs as uid:gid with a clean environment in its
  own session and its own network namespace. With a `Network`, the relay starts as root,
  enters a new network namespace, brings its loopback up, binds, then drops to uid:gid (no
  groups, no capabilities, no_new_privs) before starting the process; without one
  (graders), `unshare --net` and `setpriv` do the same with the namespace's loopback down.
  Needs CAP_SYS_ADMIN for the namespace (`resolve_mode` probes it: a root container
  without it, Docker's default, is refused with the fix named). Weaker: the process sees
  the whole file system its uid may read, the workspace's ancestors must be traversable by
  that uid, and executions share that uid (one can signal or write into another's
  workspace); use bubblewrap where isolation between executions matters.
- `none` (no bwrap, not root): only the clean environment. Weakest; logged by callers.

Everything here builds argv and checks paths; starting and killing the process is the
caller's (`handlers/runner.py`, `handlers/evaluator.py`): start it with
`Launch.popen_kwargs()` (own session; no `user=`, so any event loop can start it) and
kill the whole process group on timeout;
bwrap's `--die-with-parent` then tears the sandbox's pid namespace down.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Iterable, Mapping

MODES = ("auto", "bwrap", "setuid", "none")
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
FORBIDDEN_ENV_PREFIXES = ("GYRE_NATS", "NATS_", "GYRE_ENGINE_TOKEN", "GYRE_KEY_SECRET")
"""The run's secrets: the NATS url and token, the engines' bearer token, the execution keys' secret."""
SETPRIV = "/usr/bin/setpriv"
UNSHARE = "/usr/bin/unshare"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SandboxConfig:
    """How to confine processes.

    uid, gid: the unprivileged identity processes run as when gyre is root.
    mode: `auto` (bwrap if it works, else setuid/none), `bwrap`, `setuid`, `none`.
    readonly: extra host paths visible read-only inside (venv, harness installation);
      missing ones are skipped.
    bwrap: path of the bwrap binary; '' = look it up on PATH.
    """

    uid: int = 65534
    gid: int = 65534
    mode: str = "auto"
    readonly: tuple[str, ...] = ()
    bwrap: str = ""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"sandbox mode must be one of {MODES}, got {self.mode!r}")
        if self.uid <= 0 or self.gid <= 0:
            raise ValueError(f"sandbox uid and gid must be unprivileged (> 0), got {self.uid}:{self.gid}")
        for p in self.readonly:
            if not os.path.isabs(p):
                raise ValueError(f"sandbox readonly paths must be absolute, got {p!r}")


class SandboxError(RuntimeError):
    """A confined process cannot be started as asked; the message names the path or
    setting at fault and the fix."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Network:
    """How a confined process reaches the proxy, and nothing else (module docstring).

    port: the port the process finds the proxy at on 127.0.0.1 inside its namespace (the
      proxy's own port, so its URL does not change). socket: the host path of the Unix
      socket each connection is relayed to (the runner's relay to the proxy), visible at the
      same path inside. relay: the relay's command line up to its options
      (`[python, -I, -S, .../handlers/sandbox_relay.py]`). readonly: host paths the relay
      needs visible (its interpreter's installation and its file).
    """

    port: int
    socket: str
    relay: tuple[str, ...]
    readonly: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"sandbox network port must be in [1, 65535], got {self.port}")
        if not os.path.isabs(self.socket) or not self.relay:
            raise ValueError("sandbox network needs an absolute socket path and a relay command")


@dataclasses.dataclass(frozen=True, slots=True)
class Launch:
    """A confined command ready to start.

    argv: full command line (bwrap wrapper and the network relay included). cwd: working
    directory of the starter (the sandbox sets its own). env: the complete environment of
    the process. mode: the resolved mode. warning: '' or why confinement is weaker than
    bubblewrap's.
    """

    argv: list[str]
    cwd: str
    env: dict[str, str]
    mode: str
    warning: str = ""

    def popen_kwargs(self) -> dict:
        """Keyword arguments for subprocess.Popen / asyncio.create_subprocess_exec
        (argv excluded): own session so the caller can kill the process group."""
        return {"cwd": self.cwd, "env": self.env, "start_new_session": True, "stdin": subprocess.DEVNULL}


def find_bwrap(cfg: SandboxConfig) -> str | None:
    """Path of the bwrap binary, or None."""
    if cfg.bwrap:
        return cfg.bwrap if os.access(cfg.bwrap, os.X_OK) else None
    return shutil.which("bwrap")


def resolve_mode(cfg: SandboxConfig) -> tuple[str, str]:
    """(mode, warning) actually used for `cfg` on this host.

    `auto` probes bwrap once per process (a `true` run inside a sandbox) and falls back
    to `setuid` (root) or `none` with a warning naming the reason.
    Raises RuntimeError when `bwrap` or `setuid` is requested explicitly but impossible.
    """
    root = os.geteuid() == 0
    if cfg.mode == "bwrap":
        bwrap = find_bwrap(cfg)
        if not bwrap:
            raise RuntimeError("sandbox mode 'bwrap' requested but bwrap is not installed (apt-get install bubblewrap)")
        problem = _probe(bwrap, root)
        if problem:
            raise RuntimeError(f"sandbox mode 'bwrap' requested but bwrap does not work here: {problem}")
        return "bwrap", ""
    if cfg.mode == "setuid":
        if not root:
            raise RuntimeError("sandbox mode 'setuid' needs gyre to run as root")
        problem = _netns_probe()
        if problem:
            raise RuntimeError(f"sandbox mode 'setuid' cannot give a process its own network namespace here "
                               f"({problem}); {NETNS_FIX}")
        return "setuid", "no bubblewrap: the process sees the file system its uid may read"
    if cfg.mode == "none":
        return "none", "no confinement: the process runs as gyre's own user"
    bwrap = find_bwrap(cfg)
    reason = "bwrap is not installed (apt-get install bubblewrap)"
    if bwrap:
        problem = _probe(bwrap, root)
        if not problem:
            return "bwrap", ""
        reason = f"bwrap does not work here ({problem})"
    if root:
        problem = _netns_probe()
        if problem:
            raise RuntimeError(f"cannot confine harnesses here: {reason}, and the setuid fallback cannot give a "
                               f"process its own network namespace ({problem}); {NETNS_FIX}")
        return "setuid", f"{reason}; falling back to setuid: the process sees the file system its uid may read"
    return "none", f"{reason}; not root, so the process runs unconfined as gyre's own user"


NETNS_FIX = ("give gyre CAP_SYS_ADMIN (e.g. `docker run --cap-add SYS_ADMIN`) or a runtime where bubblewrap works "
             "(`apt-get install bubblewrap`; some need `--security-opt seccomp=unconfined`)")


@functools.lru_cache(maxsize=1)
def _netns_probe() -> str:
    """'' when this (root) process can make a network namespace (the setuid fallback's
    confinement), else why not."""
    if not os.access(UNSHARE, os.X_OK) or not os.access(SETPRIV, os.X_OK):
        return f"{UNSHARE} and {SETPRIV} are needed (Debian's util-linux)"
    try:
        res = subprocess.run([UNSHARE, "--net", "--", "/bin/true"], capture_output=True, text=True, timeout=20,
                             stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    return "" if res.returncode == 0 else (res.stderr.strip() or f"unshare --net: exit code {res.returncode}")


@functools.lru_cache(maxsize=8)
def _probe(bwrap: str, root: bool) -> str:
    """'' when bwrap can start a sandbox here (its network namespace included), else why not."""
    argv = _bwrap_argv(bwrap, root=root, uid=65534, gid=65534, cwd="/", writable=(), readonly=()) + ["/bin/true"]
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=20, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    return "" if res.returncode == 0 else (res.stderr.strip() or f"exit code {res.returncode}")


def confine(argv: list[str], *, cwd: str | Path, env: Mapping[str, str], cfg: SandboxConfig,
            writable: Iterable[str | Path] = (), readonly: Iterable[str | Path] = (),
            network: Network | None = None) -> Launch:
    """Wrap `argv` so it runs confined in `cwd`.

    cwd: working directory (made writable). env: the complete allow-listed environment
    (checked by `check_env`). writable: more host directories mounted read-write (a
    per-execution home). readonly: more host paths mounted read-only, added to
    cfg.readonly. network: how the process reaches the proxy (module docstring); None = no
    network at all (bwrap) or the host's (setuid, none). All paths absolute and identical
    inside and outside.
    Raises ValueError on a forbidden environment variable or a relative path;
    RuntimeError when the requested mode is impossible; SandboxError when the sandbox uid
    cannot read the command or a read-only path (`unreadable`).
    """
    check_env(env)
    cwd = os.path.abspath(cwd)
    rw = tuple(dict.fromkeys([cwd, *(os.path.abspath(p) for p in writable)]))
    ro = tuple(dict.fromkeys([*cfg.readonly, *(os.path.abspath(p) for p in readonly)]))
    mode, warning = resolve_mode(cfg)
    root = os.geteuid() == 0
    if mode in ("bwrap", "setuid") and root:
        command = [a for a in argv[:1] if os.path.isabs(a)]
        present = [p for p in ro if os.path.lexists(p)]  # missing read-only paths are skipped (SandboxConfig)
        problem = unreadable([*command, *present], cfg.uid, cfg.gid, binds=(*ro, *rw) if mode == "bwrap" else None)
        if problem:
            raise SandboxError(problem)
    relay: list[str] = []
    if network is not None and mode != "none":
        relay = [*network.relay, "--listen", f"127.0.0.1:{network.port}", "--socket", network.socket]
        if mode == "setuid":
            relay += ["--unshare-net", "--drop", f"{cfg.uid}:{cfg.gid}"]
        relay.append("--")
    if mode == "bwrap":
        if network is not None:
            ro = tuple(dict.fromkeys([*ro, *network.readonly, network.socket]))
        wrapped = _bwrap_argv(find_bwrap(cfg) or "bwrap", root=root, uid=cfg.uid, gid=cfg.gid, cwd=cwd,
                              writable=rw, readonly=ro) + relay + list(argv)
        return Launch(argv=wrapped, cwd="/", env=dict(env), mode=mode)
    if mode == "setuid":
        if relay:  # the relay starts as root for the namespace, then drops to uid:gid itself
            return Launch(argv=relay + list(argv), cwd=cwd, env=dict(env), mode=mode,
                          warning=warning)
        # Root makes an empty network namespace, then setpriv becomes uid:gid with no groups
        # and no capabilities (argv, not Popen's user=: uvloop does not take it).
        dropped = [UNSHARE, "--net", "--", SETPRIV, f"--reuid={cfg.uid}", f"--regid={cfg.gid}", "--clear-groups",
                   "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]
        return Launch(argv=dropped + list(argv), cwd=cwd, env=dict(env), mode=mode,
                      warning=warning)
    return Launch(argv=list(argv), cwd=cwd, env=dict(env), mode=mode, warning=warning)


def _bwrap_argv(bwrap: str, *, root: bool, uid: int, gid: int, cwd: str, writable: tuple[str, ...],
                readonly: tuple[str, ...]) -> list[str]:
    args = [bwrap, "--die-with-parent", "--new-session", "--unshare-ipc", "--unshare-pid", "--unshare-uts",
            "--unshare-net", "--unshare-cgroup-try", "--hostname", "gyre-sandbox"]
    if not root:
        args.append("--unshare-user")
    mirrored: list[str] = []   # host paths visible at the same place (their subtrees exist)
    fresh = {"/", "/tmp", "/proc", "/dev"}  # empty mount points (subdirectories must be created)
    for p in SYSTEM_PATHS:
        if os.path.islink(p):
            args += ["--symlink", os.readlink(p), p]
        elif os.path.isdir(p):
            args += ["--ro-bind", p, p]
            mirrored.append(p)
    args += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--tmpfs", "/tmp"]
    binds = [(p, "--ro-bind-try") for p in readonly] + [(p, "--bind") for p in writable]
    binds.sort(key=lambda b: b[0].count("/"))
    created: set[str] = set()
    for path, flag in binds:
        for anc in _ancestors(path):
            if any(anc.startswith(m + "/") for m in mirrored):
                break
            if anc in fresh or anc in created or anc in mirrored:
                continue
            args += ["--perms", "0755", "--dir", anc]
            created.add(anc)
        args += [flag, path, path]
        mirrored.append(path)
    args += ["--chdir", cwd]
    if root:
        # Root does the mounts; setpriv drops to the unprivileged uid and empties every
        # capability set, the bounding set included (bwrap already set no_new_privs).
        args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP", "--",
                 SETPRIV, f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--inh-caps=-all",
                 "--bounding-set=-all", "--"]
    else:
        args.append("--")
    return args


def _ancestors(path: str) -> list[str]:
    """'/a/b/c' → ['/a', '/a/b'] (proper ancestors, outermost first)."""
    parts = Path(path).parts[1:-1]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


def check_env(env: Mapping[str, str]) -> None:
    """Raise ValueError if `env` carries one of the run's secrets (`FORBIDDEN_ENV_PREFIXES`:
    a NATS setting, the engine token, the key secret), which never reach a harness."""
    for key in env:
        if key.upper().startswith(FORBIDDEN_ENV_PREFIXES):
            raise ValueError(f"environment variable {key!r} must not be passed to a confined process")


def base_env(*, home: str | Path, path_dirs: Iterable[str | Path] = (), extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """A minimal environment: PATH (path_dirs first, then the system's), HOME, TMPDIR=/tmp,
    LANG/LC_ALL=C.UTF-8, TERM=dumb, plus `extra`. Nothing is inherited from gyre."""
    path = [str(p) for p in path_dirs] + ["/usr/local/bin", "/usr/bin", "/bin"]
    env = {"PATH": ":".join(dict.fromkeys(path)), "HOME": str(home), "TMPDIR": "/tmp", "LANG": "C.UTF-8",
           "LC_ALL": "C.UTF-8", "TERM": "dumb", "PYTHONUNBUFFERED": "1"}
    env.update(extra or {})
    return env


def own_tree(path: str | Path, uid: int, gid: int) -> None:
    """chown -R `path` to uid:gid without following symlinks (so the sandboxed uid may write
    it). A no-op when gyre is not root. Raises OSError."""
    if os.geteuid() != 0:
        return
    os.chown(path, uid, gid, follow_symlinks=False)
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            os.chown(os.path.join(dirpath, name), uid, gid, follow_symlinks=False)


def _allows(st: os.stat_result, uid: int, gid: int, bits: int) -> bool:
    """Whether uid:gid (no supplementary groups) has `bits` (an `S_IRUSR | S_IXUSR`-style
    mask of the owner's bits) on a file of stat `st`."""
    if st.st_uid == uid:
        return st.st_mode & bits == bits
    if st.st_gid == gid:
        return st.st_mode & (bits >> 3) == bits >> 3
    return st.st_mode & (bits >> 6) == bits >> 6


def unreadable(paths: Iterable[str | Path], uid: int, gid: int, *,
               binds: Iterable[str] | None = None) -> str:
    """'' when uid:gid can read every one of `paths`, else a message naming the first path in
    the way and the fix. A path must exist, be readable and, if it is a directory or an
    executable file, searchable/executable; a symlink's target is checked too. binds: the
    host trees a bwrap sandbox mounts (their ancestors are made for it, mode 0755, so only
    the directories from the bind's root down count); None = the setuid fallback, where every
    ancestor from / must be searchable."""
    roots = sorted({os.path.abspath(b) for b in binds}, key=len, reverse=True) if binds is not None else None
    for raw in paths:
        path = os.path.abspath(raw)
        for target in dict.fromkeys([path, os.path.realpath(path)]):
            problem = _unreadable_one(target, uid, gid, roots)
            if problem:
                return problem
    return ""


def _unreadable_one(path: str, uid: int, gid: int, roots: list[str] | None) -> str:
    start = "/"
    if roots is not None:
        start = next((r for r in roots if path == r or path.startswith(r.rstrip("/") + "/")), "/")
        if start == "/" and not path.startswith(SYSTEM_PATHS):
            return ""  # not mounted in the sandbox: nothing to read there
    chain = [a for a in _ancestors(path) if a == start or a.startswith(start.rstrip("/") + "/")]
    for anc in chain:
        try:
            st = os.stat(anc)
        except OSError as exc:
            return f"{path} cannot be reached: {anc}: {exc.strerror}"
        if not _allows(st, uid, gid, stat.S_IXUSR):
            return _fix(path, anc, st, uid, roots, "is not searchable")
    try:
        st = os.stat(path)
    except OSError as exc:
        return f"{path} does not exist or cannot be reached ({exc.strerror})"
    bits = stat.S_IRUSR | (stat.S_IXUSR if stat.S_ISDIR(st.st_mode) or st.st_mode & 0o111 else 0)
    if not _allows(st, uid, gid, bits):
        return _fix(path, path, st, uid, roots, "is not readable")
    return ""


def _fix(path: str, blocked: str, st: os.stat_result, uid: int, roots: list[str] | None, what: str) -> str:
    mode = f"mode {stat.S_IMODE(st.st_mode):04o}"
    head = (f"{path} is not readable by the sandbox uid {uid}: it {what} ({mode})" if blocked == path else
            f"{path} is not readable by the sandbox uid {uid}: {blocked} {what} ({mode})")
    if roots is None:
        return (f"{head}. The setuid sandbox (no bubblewrap) needs every directory above the interpreter and the "
                f"harness installation searchable by that uid: install them under a world-readable prefix "
                f"(e.g. /opt), or `chmod o+x {blocked}`, or install bubblewrap (apt-get install bubblewrap), "
                f"which binds the installation into the sandbox")
    return f"{head}. Make the installation world-readable: `chmod -R o+rX {blocked}`"


def unreachable_ancestor(path: str | Path, uid: int, gid: int) -> str | None:
    """The first ancestor of `path` that uid:gid cannot traverse (setuid mode needs them
    all searchable), or None."""
    for anc in _ancestors(os.path.abspath(path)) + [os.path.abspath(path)]:
        try:
            st = os.stat(anc)
        except OSError:
            return anc
        if st.st_uid == uid:
            ok = st.st_mode & stat.S_IXUSR
        elif st.st_gid == gid:
            ok = st.st_mode & stat.S_IXGRP
        else:
            ok = st.st_mode & stat.S_IXOTH
        if not ok:
            return anc
    return None
