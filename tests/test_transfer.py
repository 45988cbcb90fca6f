"""The transfer layer: manifests, snapshot leases, and the loopback backend on real sockets."""
from __future__ import annotations

import socket
import struct
import threading
import time

import numpy as np
import orjson
import pytest

from gyre.transfer.interface import TransferError, TransferRef
from gyre.transfer.leases import LeaseError, SnapshotLeases
from gyre.transfer.manifest import ALIGN, Manifest, ManifestError, pack, unpack, verify
from handlers.transfer.loopback import LoopbackTransfer


def tensors():
    rs = np.random.default_rng(0)
    return {"b.weight": rs.standard_normal((3, 5)).astype(np.float32), "a.bias": rs.standard_normal(7),
            "c.steps": np.arange(4, dtype=np.int64), "d.empty": np.zeros((0, 3), dtype=np.float32)}


def test_pack_unpack_roundtrip_in_name_order_with_aligned_offsets():
    t = tensors()
    manifest, buf = pack(t)
    assert manifest.names() == ["a.bias", "b.weight", "c.steps", "d.empty"]
    assert all(e.offset % ALIGN == 0 for e in manifest.entries)
    assert [e.nbytes for e in manifest.entries] == [7 * 8, 15 * 4, 4 * 8, 0]
    verify(manifest, buf)
    back = unpack(manifest, buf)
    for name, a in t.items():
        assert back[name].dtype == a.dtype and np.array_equal(back[name], a)
    again = Manifest.from_json(manifest.to_json())
    assert again == manifest and again.digest() == manifest.digest() and len(manifest.digest()) == 64


def test_verify_names_the_tensor_whose_bytes_changed():
    manifest, buf = pack(tensors())
    e = manifest.entries[1]
    buf[e.offset + 3] ^= 0xFF
    with pytest.raises(ManifestError, match="b.weight"):
        verify(manifest, buf)
    with pytest.raises(ManifestError, match="buffer holds"):
        verify(manifest, buf[:-1])


def test_malformed_manifests_are_refused():
    with pytest.raises(ManifestError):
        Manifest.from_json(b"{")
    good = orjson.loads(pack(tensors())[0].to_json())
    good["entries"][0]["nbytes"] += 8  # no longer dtype × shape
    with pytest.raises(ManifestError, match="a.bias"):
        Manifest.from_json(orjson.dumps(good))


def test_leases_hold_a_withdrawn_snapshot_until_every_reader_confirmed_or_gave_up():
    leases = SnapshotLeases()
    leases.expose("v1", now=0.0)
    leases.claim("v1", "cell1", now=0.0, lease_s=10.0)
    leases.claim("v1", "cell2", now=1.0, lease_s=10.0)
    leases.withdraw("v1")
    with pytest.raises(LeaseError):
        leases.claim("v1", "cell3", now=2.0, lease_s=10.0)  # no new claim after withdraw
    leases.renew("v1", "cell1", now=9.0, lease_s=10.0)  # cell1 still pulling: to 19
    leases.release("v1", "cell2")  # confirmed
    assert leases.releasable(now=12.0) == []  # cell1's renewed lease is live
    with pytest.raises(LeaseError, match="still held"):
        leases.expose("v1", now=12.0)  # never reused while held
    assert leases.releasable(now=19.5) == ["v1"]  # cell1's lease ran out: it gave up
    with pytest.raises(LeaseError):
        leases.renew("v1", "cell1", now=20.0, lease_s=10.0)
    leases.expose("v1", now=21.0)  # free again


@pytest.fixture
def pair():
    owner, reader = LoopbackTransfer(lease_s=5.0), LoopbackTransfer(lease_s=5.0)
    yield owner, reader
    owner.close()
    reader.close()


def test_loopback_pull_returns_verified_tensors(pair):
    owner, reader = pair
    t = tensors()
    ref = owner.expose("weights-v3", t)
    assert ref.key == f"loopback://127.0.0.1:{owner.port}/weights-v3"
    got = reader.pull(ref, "cell1")
    assert set(got) == set(t) and all(np.array_equal(got[k], t[k]) for k in t)
    with pytest.raises(TransferError, match="not offered"):
        reader.pull(TransferRef(ref.key.replace("v3", "v4"), ref.digest), "cell1")
    with pytest.raises(TransferError, match="manifest digest"):
        reader.pull(TransferRef(ref.key, "0" * 64), "cell1")  # another snapshot than the event named
    owner.withdraw("weights-v3")
    # The owner learns that a reader gave up (the wrong digest) on its serving thread, after
    # `pull` has returned; the snapshot goes once that reader's claim is released.
    deadline = time.monotonic() + 5.0
    while owner.exposed() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert owner.exposed() == []
    with pytest.raises(TransferError, match="not offered"):
        reader.pull(ref, "cell1")


def test_a_withdrawn_snapshot_stays_while_a_reader_pulls_it(pair):
    owner, _ = pair
    owner.expose("grad", {"w": np.ones(1 << 20, dtype=np.float64)})  # 8 MiB: more than the socket buffers
    sock = socket.create_connection(("127.0.0.1", owner.port))
    payload = orjson.dumps({"name": "grad", "reader": "slow"})
    sock.sendall(struct.pack(">I", len(payload)) + payload)
    sock.recv(4)  # the reader has begun, then stalls
    owner.withdraw("grad")
    time.sleep(0.2)
    assert owner.exposed() == ["grad"]  # held by the slow reader's lease
    sock.close()  # it gives up
    deadline = time.monotonic() + 5
    while owner.exposed() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert owner.exposed() == []


def _fake_owner(manifest_json: bytes, body: bytes) -> tuple[socket.socket, threading.Thread]:
    """An owner speaking the wire protocol with whatever bytes it is given."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = server.accept()
        with conn:
            (n,) = struct.unpack(">I", conn.recv(4))
            conn.recv(n)
            head = orjson.dumps({"ok": True, "manifest": manifest_json.decode()})
            conn.sendall(struct.pack(">I", len(head)) + head + body)
            conn.shutdown(socket.SHUT_WR)  # all it has: a short body ends here
            try:
                conn.recv(1)
            except OSError:
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return server, thread


@pytest.mark.parametrize("damage", ["flip", "short"])
def test_a_corrupted_or_short_transfer_is_never_returned(pair, damage):
    _, reader = pair
    manifest, buf = pack(tensors())
    body = bytes(buf)
    body = body[:10] + bytes([body[10] ^ 1]) + body[11:] if damage == "flip" else body[:-5]
    server, thread = _fake_owner(manifest.to_json(), body)
    try:
        ref = TransferRef(f"loopback://127.0.0.1:{server.getsockname()[1]}/x", manifest.digest())
        with pytest.raises(TransferError, match="checksum" if damage == "flip" else "short transfer"):
            reader.pull(ref, "cell1")
    finally:
        server.close()
        thread.join(5)
