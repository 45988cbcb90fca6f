"""The network relay of a harness sandbox (gyre.env.sandbox, "Network"), both ends.

Inside the sandbox, run as a script on the standard library alone (`python -I -S
handlers/sandbox_relay.py --listen 127.0.0.1:PORT --socket PATH [--unshare-net --drop
UID:GID] -- ARGV...`):
1. with `--unshare-net` (root only: the setuid fallback; bubblewrap has made the namespace
   already) a new network namespace, its loopback brought up;
2. listen on 127.0.0.1:PORT, the proxy's port, so the harness's URL stays the proxy's;
3. with `--drop`, become UID:GID with no supplementary groups, an empty capability
   bounding set and no_new_privs;
4. start ARGV as a child (same session and process group, stdio inherited; SIGTERM,
   SIGINT and SIGHUP passed on) and relay each connection to PORT to the Unix socket PATH
   (the runner's end, below), bytes as they come both ways, a half-close passed on;
5. exit with the child's status (128 + N when signal N ended it) once it has exited.
A step before the child starts that fails exits 125 with the reason on stderr (the
execution's log).

Outside, `ProxyRelay` (in the runner's event loop): a Unix socket server whose every
connection is relayed to the proxy's TCP address at that moment (a restarted proxy may have
moved). So a sandboxed harness reaches the proxy and nothing else.
"""
from __future__ import annotations

import argparse
import asyncio
import ctypes
import fcntl
import os
import signal
import socket
import struct
import sys
from collections.abc import Callable

CHUNK = 64 * 1024
FAILED = 125
"""Exit status when the relay cannot set up (before the child starts)."""

_CLONE_NEWNET = 0x40000000
_PR_SET_NO_NEW_PRIVS = 38
_PR_CAPBSET_DROP = 24
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                other: asyncio.StreamWriter) -> None:
    """Copy `reader` into `writer` until EOF (then half-close `writer`); on a reset both
    connections are cut, so the opposite direction ends too."""
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (OSError, RuntimeError):  # reset, broken pipe; a write after close
        writer.transport.abort()
        other.transport.abort()


async def splice(r1: asyncio.StreamReader, w1: asyncio.StreamWriter, r2: asyncio.StreamReader,
                 w2: asyncio.StreamWriter) -> None:
    """Relay two connections both ways until both directions have ended; then close both."""
    try:
        await asyncio.gather(_pipe(r1, w2, w1), _pipe(r2, w1, w2))
    finally:
        for w in (w1, w2):
            w.close()


class ProxyRelay:
    """The runner's end of the harnesses' network: a Unix socket at `path` (mode 0600,
    owned by `owner` uid:gid when given) relaying each connection to the TCP address
    `target()` names at that moment ((host, port), or None when no proxy is known: the
    connection is closed). `start` binds it, `close` removes it."""

    def __init__(self, path: str, target: Callable[[], tuple[str, int] | None],
                 owner: tuple[int, int] | None = None) -> None:
        self.path = path
        self.target = target
        self.owner = owner
        self.server: asyncio.base_events.Server | None = None
        self.connections = 0
        """Connections relayed so far (a count for tests and logs)."""
        self._open: set[asyncio.Task] = set()

    async def start(self) -> None:
        if os.path.lexists(self.path):
            os.unlink(self.path)
        self.server = await asyncio.start_unix_server(self._handle, path=self.path)
        os.chmod(self.path, 0o600)
        if self.owner is not None:
            os.chown(self.path, *self.owner)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        if task is not None:
            self._open.add(task)
        try:
            target = self.target()
            try:
                if target is None:
                    raise OSError("no proxy is known")
                up_reader, up_writer = await asyncio.open_connection(*target)
            except OSError:
                writer.transport.abort()  # the harness sees a refused/reset connection and retries
                return
            await splice(reader, writer, up_reader, up_writer)
        finally:
            self._open.discard(task)

    async def close(self) -> None:
        """Stop accepting, end the connections still relayed (their harnesses lose the
        proxy), and remove the socket."""
        server, self.server = self.server, None
        if server is not None:
            server.close()
        for task in list(self._open):
            task.cancel()
        await asyncio.gather(*self._open, return_exceptions=True)
        if server is not None:
            await server.wait_closed()
        if os.path.lexists(self.path):
            os.unlink(self.path)


# --------------------------------------------------------------------------- inside the sandbox


def _libc_call(name: str, *args: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if getattr(libc, name)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}: {os.strerror(err)}")


def _loopback_up() -> None:
    """Bring `lo` of the current network namespace up (a new one starts with it down)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifr = struct.pack("16sh22x", b"lo", 0)
        flags = struct.unpack("16sh22x", fcntl.ioctl(s, _SIOCGIFFLAGS, ifr))[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sh22x", b"lo", flags | _IFF_UP))


def _drop(uid: int, gid: int) -> None:
    """Become uid:gid for good: no groups, no capability left or to be gained."""
    try:
        last = int(open("/proc/sys/kernel/cap_last_cap").read())
    except (OSError, ValueError):
        last = 63
    for cap in range(last + 1):
        _libc_call("prctl", _PR_CAPBSET_DROP, cap, 0, 0, 0)
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    _libc_call("prctl", _PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    if os.getuid() != uid or os.geteuid() != uid or os.getgroups():
        raise OSError("the identity did not change")


def _listener(spec: str) -> socket.socket:
    host, _, port = spec.rpartition(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, int(port)))
    sock.listen(128)
    return sock


async def _serve(listener: socket.socket, path: str, argv: list[str]) -> int:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_unix_connection(path)
        except OSError as exc:
            print(f"gyre sandbox relay: cannot reach the proxy socket {path}: {exc}", file=sys.stderr, flush=True)
            writer.transport.abort()
            return
        await splice(reader, writer, up_reader, up_writer)

    server = await asyncio.start_server(handle, sock=listener)
    proc = await asyncio.create_subprocess_exec(*argv)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, proc.send_signal, sig)
    code = await proc.wait()
    server.close()
    return code if code >= 0 else 128 - code


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="sandbox_relay", description="relay a sandbox's proxy port to a Unix socket, "
                                                                  "around a child command")
    p.add_argument("--listen", required=True, help="HOST:PORT to listen on inside the sandbox")
    p.add_argument("--socket", required=True, help="Unix socket each connection is relayed to")
    p.add_argument("--unshare-net", action="store_true", help="enter a new network namespace first (root)")
    p.add_argument("--drop", default="", help="UID:GID to become once listening (root)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- ARGV of the child")
    a = p.parse_args(argv)
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command:
        p.error("no command after --")
    try:
        if a.unshare_net:
            _libc_call("unshare", _CLONE_NEWNET)
            _loopback_up()
        listener = _listener(a.listen)
        if a.drop:
            uid, _, gid = a.drop.partition(":")
            _drop(int(uid), int(gid))
    except (OSError, ValueError) as exc:
        print(f"gyre sandbox relay: cannot set up the sandbox's network: {exc}", file=sys.stderr, flush=True)
        return FAILED
    try:
        return asyncio.run(_serve(listener, a.socket, command))
    except OSError as exc:  # the child could not be started
        print(f"gyre sandbox relay: cannot start {command[0]}: {exc}", file=sys.stderr, flush=True)
        return FAILED


if __name__ == "__main__":
    sys.exit(main())
