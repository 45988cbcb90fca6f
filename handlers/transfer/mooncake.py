"""The Mooncake transfer backend: snapshot bytes move through Mooncake's transfer engine.

Satisfies gyre.transfer.interface.TransferBackend beside the loopback backend
(handlers.transfer.loopback), whose control protocol it keeps: a reader asks the owner for
a snapshot over one short TCP connection on the owner's control port (lease claim, manifest,
verdict), but the bytes do not follow on that connection: the owner registers every
snapshot buffer with its Mooncake engine and answers with the engine's session
(`HOST:RPC_PORT`) and the buffer's address; the reader reads them into its own registered
buffer with Mooncake (TCP on CPU; RDMA with `protocol="rdma"` on a cluster) in slices of
`slice_bytes`, telling the owner after each slice (one byte, 2) so its lease is renewed.
Keys are `mooncake://HOST:PORT/NAME` (the control port).

Mooncake's engine binds every interface. `MooncakeTransfer` therefore refuses to start
(MooncakeUnavailable, a clear message) outside a private network namespace — one whose only
interface is loopback (`unshare -n`, lo up; see `namespace_command`) — unless `cluster=True`
says the deployment exposes it on purpose. It also refuses where the `mooncake` package or
`libibverbs` is missing (`available()` says why).

A caller that pulls version after version may pass its receive buffer (`pull(into=...)`): it
stays registered with the engine until `close`. A pull is refused (TransferError, never a
partial result) when Mooncake reports a failed or
timed-out slice (its status code is checked for every slice), when the pull runs past
`timeout_s`, when the caller's `cancel` event is set, and when the bytes do not verify.
"""
from __future__ import annotations

import os
import shutil
import socket
import threading
import time

import numpy as np
import structlog

from gyre.transfer.interface import TransferError, TransferRef
from gyre.transfer.manifest import Manifest
from handlers.transfer.loopback import LoopbackTransfer, _recv_exact

log = structlog.get_logger()

SCHEME = "mooncake://"
PROGRESS = b"\x02"
"""The reader's byte after each slice: the owner renews its lease."""


class MooncakeUnavailable(RuntimeError):
    """Mooncake cannot run here (not installed, no libibverbs, or not in a private network
    namespace); the message says which and what to do."""


def private_namespace() -> bool:
    """Whether this process's network namespace has no interface but loopback."""
    return [name for _, name in socket.if_nameindex()] == ["lo"]


def available() -> str | None:
    """None when the Mooncake engine can be imported; else why not."""
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except ImportError as exc:
        return (f"Mooncake's transfer engine cannot be imported ({exc}); the install step (ops/install.sh) "
                "installs mooncake-transfer-engine-non-cuda and Debian's libibverbs1")
    return None


def refusal(cluster: bool) -> str | None:
    """Why this process may not start Mooncake (not importable; outside a private network
    namespace on a machine not configured as a cluster), or None."""
    why = available()
    if why is not None:
        return why
    if not cluster and not private_namespace():
        names = [name for _, name in socket.if_nameindex()]
        return (f"Mooncake binds every interface and this network namespace has {names}: run it inside a private "
                "network namespace (`unshare -n`, lo up; handlers.transfer.mooncake.namespace_command) or set the "
                "recipe's cells.transfer_cluster = true on a cluster that exposes it on purpose")
    return None


def namespace_command(argv: list[str]) -> list[str]:
    """`argv` run in a fresh private network namespace whose loopback is up (needs root or
    user namespaces, and `unshare` and `ip`). Raises MooncakeUnavailable where it cannot."""
    missing = [tool for tool in ("unshare", "ip") if shutil.which(tool) is None]
    if missing:
        raise MooncakeUnavailable(f"{' and '.join(missing)} not found: cannot make a private network namespace")
    script = 'ip link set lo up && exec "$@"'
    return ["unshare", "-n", "--", "sh", "-c", script, "sh", *argv]


class MooncakeTransfer(LoopbackTransfer):
    """A process's Mooncake backend (module docstring).

    protocol: Mooncake's transport (`tcp` here, `rdma` on a cluster). cluster: the
    configuration says this is a cluster whose interfaces Mooncake may bind. timeout_s: the
    most a pull may take, seconds (also the control connection's timeout).
    """

    scheme = SCHEME

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, lease_s: float = 30.0,
                 slice_bytes: int = 64 << 20, timeout_s: float = 60.0, keepalive_s: float = 10.0,
                 protocol: str = "tcp", cluster: bool = False) -> None:
        why = refusal(cluster)
        if why is not None:
            raise MooncakeUnavailable(why)
        os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(max(5, int(timeout_s))))
        # Mooncake's TCP transport moves a request in slices of MC_TCP_SLICE_SIZE (64 KiB by
        # default); one slice per read of ours (64 MiB) halves its cost here (docs/results.md,
        # gyre bench transfer).
        os.environ.setdefault("MC_TCP_SLICE_SIZE", str(slice_bytes))
        from mooncake.engine import TransferEngine

        self._engine = TransferEngine()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, "")
        if rc != 0:
            raise MooncakeUnavailable(f"Mooncake's transfer engine did not start on {host} over {protocol} (code {rc})")
        self.session = f"{host}:{self._engine.get_rpc_port()}"
        self._registered: dict[int, int] = {}
        self._reg_lock = threading.Lock()
        super().__init__(host=host, port=port, lease_s=lease_s, slice_bytes=slice_bytes, timeout_s=timeout_s,
                         keepalive_s=keepalive_s)
        log.info("transfer.mooncake.started", session=self.session, control=self.url, protocol=protocol)

    # -- registered memory ----------------------------------------------------------------------
    @staticmethod
    def _address(buf: bytearray | np.ndarray) -> int:
        return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data) if len(buf) else 0

    def _register(self, buf) -> int:
        addr = self._address(buf)
        if addr:
            with self._reg_lock:
                rc = self._engine.register_memory(addr, len(buf))
                if rc != 0:
                    raise TransferError(f"Mooncake refused to register {len(buf)} bytes (code {rc})")
                self._registered[addr] = len(buf)
        return addr

    def _unregister(self, addr: int) -> None:
        with self._reg_lock:
            if self._registered.pop(addr, None) is not None:
                self._engine.unregister_memory(addr)

    # -- owner side -------------------------------------------------------------------------------
    def _hold(self, name: str, buf: bytearray) -> None:
        self._register(buf)

    def _drop(self, name: str, buf: bytearray) -> None:
        self._unregister(self._address(buf))

    def _where(self, name: str, buf: bytearray) -> dict:
        return {"session": self.session, "address": self._address(buf)}

    def _deliver(self, conn: socket.socket, name: str, reader: str, view: memoryview) -> bytes:
        """The reader reads the bytes itself; each progress byte renews its lease. Returns the
        verdict byte (a stalled reader times the connection out after `lease_s`)."""
        while True:
            b = _recv_exact(conn, 1)
            if b != PROGRESS:
                return b
            self._renew(name, reader)

    # -- reader side --------------------------------------------------------------------------------
    def _fetch(self, sock: socket.socket, ref: TransferRef, head: dict, manifest: Manifest,
               cancel: threading.Event | None = None, started: float | None = None,
               timings: dict[str, float] | None = None, into: bytearray | None = None) -> bytearray:
        try:
            session, remote = str(head["session"]), int(head["address"])
        except (KeyError, TypeError, ValueError):
            raise TransferError(f"{ref.key}: the owner's answer names no Mooncake session and address") from None
        total = manifest.total_bytes
        timings = {} if timings is None else timings
        t0 = time.perf_counter()
        kept = into is not None and len(into) == total
        buf = into if kept else bytearray(total)
        timings["alloc_s"] = time.perf_counter() - t0
        if not total:
            return buf
        started = time.monotonic() if started is None else started
        t0 = time.perf_counter()
        local = self._address(buf)
        if not (kept and local in self._registered):
            local = self._register(buf)
        timings["register_s"] = time.perf_counter() - t0
        timings["read_s"] = timings["progress_s"] = 0.0
        timings["slices"] = 0
        try:
            for offset in range(0, total, self.slice_bytes):
                if cancel is not None and cancel.is_set():
                    raise TransferError(f"{ref.key}: cancelled after {offset} of {total} bytes")
                if time.monotonic() - started > self.timeout_s:
                    raise TransferError(f"{ref.key}: timed out after {offset} of {total} bytes ({self.timeout_s} s)")
                n = min(self.slice_bytes, total - offset)
                t0 = time.perf_counter()
                rc = self._engine.transfer_sync_read(session, local + offset, remote + offset, n)
                t1 = time.perf_counter()
                timings["read_s"] += t1 - t0
                timings["slices"] += 1
                if rc != 0:
                    lost = [e.name for e in manifest.entries if e.offset < offset + n and e.offset + e.nbytes > offset]
                    raise TransferError(f"{ref.key}: Mooncake read of bytes {offset}..{offset + n} of {total} from "
                                        f"{session} failed (code {rc}: failed, timed out or short); tensors not "
                                        f"received: {', '.join(repr(t) for t in lost[:8])}")
                sock.sendall(PROGRESS)
                timings["progress_s"] += time.perf_counter() - t1
            if time.monotonic() - started > self.timeout_s:
                raise TransferError(f"{ref.key}: timed out after {total} bytes ({self.timeout_s} s)")
            if cancel is not None and cancel.is_set():
                raise TransferError(f"{ref.key}: cancelled after {total} of {total} bytes")
        finally:
            if not kept:
                self._unregister(local)
        return buf

    def close(self) -> None:
        super().close()
        with self._reg_lock:
            for addr in list(self._registered):
                self._engine.unregister_memory(addr)
            self._registered.clear()
