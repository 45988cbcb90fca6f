"""The loopback transfer backend: snapshots pulled over TCP, one connection per pull.

Satisfies gyre.transfer.interface.TransferBackend where Mooncake is not configured. A
process's backend listens on 127.0.0.1 (a free port by default) and serves the snapshots it
exposes from an accept thread, one thread per connection. Keys are
`loopback://HOST:PORT/NAME`.

Wire protocol of one pull (lengths are 4-byte big-endian):
  reader → owner: len + JSON {"name", "reader"}
  owner → reader: len + JSON {"ok": true, "manifest": <manifest JSON>} or {"ok": false, "error"}
  owner → reader: the snapshot's `total_bytes`, in slices of `slice_bytes`
  reader → owner: one byte, 1 = verified, 0 = gave up
The owner claims a lease for the reader before it sends and renews it after each slice; the
lease ends with the reader's byte, a closed connection, or `lease_s` without progress
(gyre.transfer.leases). A withdrawn snapshot's buffer is freed only then.
"""
from __future__ import annotations

import re
import socket
import struct
import threading
import time
from collections.abc import Mapping

import numpy as np
import orjson
import structlog

from gyre.transfer.interface import TransferError, TransferRef
from gyre.transfer.leases import LeaseError, SnapshotLeases
from gyre.transfer.manifest import Manifest, ManifestError, pack, unpack, verify

log = structlog.get_logger()

SCHEME = "loopback://"
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
_MAX_HEADER = 64 * 1024 * 1024


def _send_frame(sock: socket.socket, obj: dict) -> None:
    data = orjson.dumps(obj)
    sock.sendall(struct.pack(">I", len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


def _recv_frame(sock: socket.socket) -> dict:
    (n,) = struct.unpack(">I", _recv_exact(sock, 4))
    if n > _MAX_HEADER:
        raise ConnectionError(f"frame of {n} bytes is too large")
    return orjson.loads(_recv_exact(sock, n))


def _say(sock: socket.socket, verdict: bytes) -> None:
    """Send the reader's verdict byte; an owner that is gone already needs none."""
    try:
        sock.sendall(verdict)
    except OSError:
        pass


def parse_key(key: str, scheme: str = SCHEME) -> tuple[str, int, str]:
    """(host, port, name) of a key `<scheme>HOST:PORT/NAME`. Raises TransferError."""
    m = re.fullmatch(re.escape(scheme) + r"([0-9.]+|localhost):(\d+)/([A-Za-z0-9._-]+)", key)
    if not m:
        raise TransferError(f"not a {scheme.rstrip(':/')} transfer key: {key!r}")
    return m.group(1), int(m.group(2)), m.group(3)


class LoopbackTransfer:
    """A process's loopback backend (module docstring).

    lease_s: seconds a reader's lease lasts without progress. slice_bytes: bytes per send.
    timeout_s: connect and per-receive timeout of a pull, seconds. keepalive_s: TCP keep-alive
    idle time of every control connection, seconds (a peer that vanished is noticed).
    """

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, lease_s: float = 30.0,
                 slice_bytes: int = 4 << 20, timeout_s: float = 60.0, keepalive_s: float = 10.0) -> None:
        self.lease_s = lease_s
        self.keepalive_s = keepalive_s
        self.slice_bytes = slice_bytes
        self.timeout_s = timeout_s
        self._server = socket.create_server((host, port))
        self.host, self.port = self._server.getsockname()[:2]
        self._lock = threading.Lock()
        self._snapshots: dict[str, tuple[Manifest, bytearray]] = {}
        self._leases = SnapshotLeases()
        self._closed = threading.Event()
        self._accept = threading.Thread(target=self._accept_loop, name="transfer-accept", daemon=True)
        self._accept.start()

    scheme = SCHEME

    @property
    def url(self) -> str:
        return f"{self.scheme}{self.host}:{self.port}"

    # -- owner side -------------------------------------------------------------------------
    def expose(self, name: str, tensors: Mapping[str, np.ndarray]) -> TransferRef:
        """Offer `tensors` as snapshot `name` (replacing an earlier, unheld one). Raises
        ValueError for a bad name, LeaseError while readers hold an earlier snapshot of it."""
        if not _NAME.match(name):
            raise ValueError(f"snapshot name {name!r} must match {_NAME.pattern}")
        manifest, buf = pack(tensors)
        with self._lock:
            self._leases.expose(name, time.monotonic())
            old = self._snapshots.pop(name, None)
            if old is not None:
                self._drop(name, old[1])
            self._hold(name, buf)
            self._snapshots[name] = (manifest, buf)
        return TransferRef(f"{self.url}/{name}", manifest.digest())

    def withdraw(self, name: str) -> None:
        """Stop offering `name`; freed once no reader holds it."""
        with self._lock:
            self._leases.withdraw(name)
            self._free()

    def exposed(self) -> list[str]:
        """Names whose buffers are still held (offered, or withdrawn but leased)."""
        with self._lock:
            self._free()
            return sorted(self._snapshots)

    def _free(self) -> None:
        for name in self._leases.releasable(time.monotonic()):
            entry = self._snapshots.pop(name, None)
            if entry is not None:
                self._drop(name, entry[1])

    def _hold(self, name: str, buf: bytearray) -> None:
        """A snapshot's buffer is about to be offered (a backend registers it here)."""

    def _drop(self, name: str, buf: bytearray) -> None:
        """A snapshot's buffer is freed: no reader holds it (a backend unregisters it here)."""

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._server.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), name="transfer-serve", daemon=True).start()

    def _keepalive(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        idle = max(1, int(self.keepalive_s))
        for opt, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", max(1, idle // 2)), ("TCP_KEEPCNT", 3)):
            if hasattr(socket, opt):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)

    def _serve(self, conn: socket.socket) -> None:
        name = reader = ""
        claimed = False
        try:
            self._keepalive(conn)
            conn.settimeout(self.lease_s)
            req = _recv_frame(conn)
            name, reader = str(req.get("name", "")), str(req.get("reader", ""))
            with self._lock:
                entry = self._snapshots.get(name)
                try:
                    if entry is None:
                        raise LeaseError(f"snapshot {name!r} is not offered")
                    self._leases.claim(name, reader, time.monotonic(), self.lease_s)
                    claimed = True
                except LeaseError as exc:
                    _send_frame(conn, {"ok": False, "error": str(exc)})
                    return
            manifest, buf = entry
            _send_frame(conn, {"ok": True, "manifest": manifest.to_json().decode(), **self._where(name, buf)})
            verdict = self._deliver(conn, name, reader, memoryview(buf))
            log.debug("transfer.served", snapshot=name, reader=reader, verified=verdict == b"\x01", bytes=len(buf))
        except (OSError, ConnectionError, LeaseError, ValueError) as exc:
            log.info("transfer.serve.ended", snapshot=name, reader=reader, error=repr(exc))
        finally:
            conn.close()
            if claimed:
                with self._lock:
                    self._leases.release(name, reader)
                    self._free()

    def _where(self, name: str, buf: bytearray) -> dict:
        """Fields the owner adds to its answer so the reader can fetch the bytes (none here:
        they follow on the connection)."""
        return {}

    def _deliver(self, conn: socket.socket, name: str, reader: str, view: memoryview) -> bytes:
        """Move the snapshot's bytes to the reader, renewing its lease after each slice;
        returns the reader's verdict byte."""
        for start in range(0, len(view), self.slice_bytes):
            conn.sendall(view[start:start + self.slice_bytes])
            self._renew(name, reader)
        return _recv_exact(conn, 1)

    def _renew(self, name: str, reader: str) -> None:
        with self._lock:
            self._leases.renew(name, reader, time.monotonic(), self.lease_s)

    # -- reader side ------------------------------------------------------------------------
    def pull(self, ref: TransferRef, reader: str, cancel: threading.Event | None = None,
             timings: dict[str, float] | None = None, into: bytearray | None = None) -> dict[str, np.ndarray]:
        """Fetch and verify snapshot `ref` (from any process's backend of this kind). Raises
        TransferError for an unknown snapshot, a manifest other than `ref.digest`, a short,
        failed, timed-out or cancelled (`cancel` set) transfer, or a checksum mismatch.
        `timings`, when given, receives seconds: `handshake_s` (connect, claim, manifest),
        `fetch_s` (the bytes), `verify_s` (the checksums), and what the backend adds. `into`:
        a receive buffer of the snapshot's size to read into (the returned arrays view it), kept
        by a caller that pulls version after version; otherwise a new one."""
        host, port, name = parse_key(ref.key, self.scheme)
        started = time.monotonic()
        timings = {} if timings is None else timings
        started_pc = time.perf_counter()
        try:
            with socket.create_connection((host, port), timeout=self.timeout_s) as sock:
                self._keepalive(sock)
                _send_frame(sock, {"name": name, "reader": reader})
                head = _recv_frame(sock)
                if not head.get("ok"):
                    raise TransferError(f"{ref.key}: {head.get('error', 'refused')}")
                manifest = Manifest.from_json(head["manifest"].encode())
                if manifest.digest() != ref.digest:
                    _say(sock, b"\x00")
                    raise TransferError(f"{ref.key}: manifest digest {manifest.digest()} is not {ref.digest}")
                fetching = time.perf_counter()
                timings["handshake_s"] = fetching - started_pc
                try:
                    buf = self._fetch(sock, ref, head, manifest, cancel, started, timings, into)
                except TransferError:
                    _say(sock, b"\x00")
                    raise
                verifying = time.perf_counter()
                timings["fetch_s"] = verifying - fetching
                try:
                    verify(manifest, buf)
                    timings["verify_s"] = time.perf_counter() - verifying
                except ManifestError as exc:
                    _say(sock, b"\x00")
                    raise TransferError(f"{ref.key}: {exc}") from None
                sock.sendall(b"\x01")
        except (OSError, ConnectionError, ManifestError, KeyError, ValueError) as exc:
            raise TransferError(f"{ref.key}: {exc!r}") from exc
        return unpack(manifest, buf)

    def _fetch(self, sock: socket.socket, ref: TransferRef, head: dict, manifest: Manifest,
               cancel: threading.Event | None = None, started: float | None = None,
               timings: dict[str, float] | None = None, into: bytearray | None = None) -> bytearray:
        """The snapshot's bytes (`manifest.total_bytes` of them, unverified), in `into` when
        it has that size. Raises TransferError for a short or cancelled transfer."""
        buf = into if into is not None and len(into) == manifest.total_bytes else bytearray(manifest.total_bytes)
        view, got = memoryview(buf), 0
        while got < len(buf):
            if cancel is not None and cancel.is_set():
                raise TransferError(f"{ref.key}: cancelled after {got} of {len(buf)} bytes")
            k = sock.recv_into(view[got:])
            if k == 0:
                raise TransferError(f"{ref.key}: short transfer, {got} of {len(buf)} bytes")
            got += k
        return buf

    def close(self) -> None:
        """Stop serving (connections in progress end with their threads)."""
        self._closed.set()
        try:
            self._server.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        except OSError:
            pass
        try:
            self._server.close()
        except OSError:
            pass
        self._accept.join(timeout=5)
