"""A transfer peer in its own process, for the Mooncake fault tests (tests/ns_mooncake.py).

`python -m tests.transfer_peer owner LEASE_S KEEPALIVE_S` — an owner (MooncakeTransfer)
driven by JSON lines on stdin, one JSON answer per line on stdout:
  {"op": "expose", "name", "seed", "mib"} → {"key", "digest"}: seeded float32 tensors of mixed sizes
  {"op": "expose_model", "name", "model_dir", "delta"} → the model's weights + delta
  {"op": "sabotage", "name", "how"}: the bytes a reader gets differ from the manifest's —
      `zeros` (a region of zeros: no bytes of the snapshot moved), `short` (only the first half
      of the region is registered: the rest cannot be read), `flip` (one byte of the first
      tensor flipped in place)
  {"op": "withdraw", "name"}, {"op": "exposed"} → {"names"}
`python -m tests.transfer_peer reader KEY DIGEST DELAY_S NAME` — a reader `NAME` that pulls slowly
(DELAY_S before each 1 MiB slice: a slow network) and prints `pulled` when done.
"""
from __future__ import annotations

import sys
import time

import numpy as np
import orjson

from gyre.transfer.interface import TransferRef
from handlers.transfer.mooncake import MooncakeTransfer


def seeded(seed: int, mib: int) -> dict[str, np.ndarray]:
    """Float32 tensors of mixed sizes, `mib` MiB in all, determined by `seed`."""
    rs = np.random.default_rng(seed)
    n = (mib << 20) // 4
    sizes = [n // 2, n // 4, n // 8, n - n // 2 - n // 4 - n // 8 - 100, 100]
    return {f"layer{i}.weight": rs.standard_normal(k, dtype=np.float32) for i, k in enumerate(sizes)}


class SlowEngine:
    """Mooncake's engine with a delay before every read (a slow link)."""

    def __init__(self, engine, delay_s: float) -> None:
        self._engine, self.delay_s = engine, delay_s

    def transfer_sync_read(self, *args):
        time.sleep(self.delay_s)
        return self._engine.transfer_sync_read(*args)

    def __getattr__(self, name):
        return getattr(self._engine, name)


def slow(transfer: MooncakeTransfer, delay_s: float) -> MooncakeTransfer:
    transfer._engine = SlowEngine(transfer._engine, delay_s)
    return transfer


class Owner(MooncakeTransfer):
    """An owner whose answers can be sabotaged (module docstring)."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.fake: dict[str, int] = {}
        self._keep: list = []

    def _where(self, name: str, buf: bytearray) -> dict:
        where = super()._where(name, buf)
        if name in self.fake:
            where["address"] = self.fake[name]
        return where

    def sabotage(self, name: str, how: str) -> None:
        manifest, buf = self._snapshots[name]
        if how == "flip":
            e = manifest.entries[0]
            buf[e.offset + 5] ^= 0x10
            return
        region = bytearray(len(buf))
        self._keep.append(region)
        if how == "short":
            addr = self._address(region)
            rc = self._engine.register_memory(addr, len(region) // 2)
            assert rc == 0
        else:
            addr = self._register(region)
        self.fake[name] = addr


def owner(lease_s: float, keepalive_s: float) -> None:
    t = Owner(lease_s=lease_s, keepalive_s=keepalive_s, slice_bytes=1 << 20)
    print(orjson.dumps({"ready": True}).decode(), flush=True)
    for line in sys.stdin:
        cmd = orjson.loads(line)
        op = cmd["op"]
        try:
            if op == "expose":
                ref = t.expose(cmd["name"], seeded(cmd["seed"], cmd["mib"]))
                out = {"key": ref.key, "digest": ref.digest}
            elif op == "expose_model":
                from safetensors.numpy import load_file

                tensors = {k: v + np.asarray(cmd["delta"], dtype=v.dtype)
                           for k, v in load_file(f"{cmd['model_dir']}/model.safetensors").items()}
                ref = t.expose(cmd["name"], tensors)
                out = {"key": ref.key, "digest": ref.digest}
            elif op == "sabotage":
                t.sabotage(cmd["name"], cmd["how"])
                out = {"ok": True}
            elif op == "withdraw":
                t.withdraw(cmd["name"])
                out = {"ok": True}
            elif op == "exposed":
                out = {"names": t.exposed()}
            elif op == "claims":
                with t._lock:
                    out = {"claims": {n: sorted(c) for n, c in t._leases.claims.items()}}
            else:
                out = {"error": f"unknown op {op}"}
        except Exception as exc:  # noqa: BLE001 - the test reads the error
            out = {"error": f"{type(exc).__name__}: {exc}"}
        print(orjson.dumps(out).decode(), flush=True)
    t.close()


def reader(key: str, digest: str, delay_s: float, name: str) -> None:
    t = slow(MooncakeTransfer(slice_bytes=1 << 20), delay_s)
    print("started", flush=True)
    t.pull(TransferRef(key, digest), name)
    print("pulled", flush=True)
    t.close()


if __name__ == "__main__":
    import structlog

    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))  # stdout carries answers
    if sys.argv[1] == "owner":
        owner(float(sys.argv[2]), float(sys.argv[3]))
    else:
        reader(sys.argv[2], sys.argv[3], float(sys.argv[4]), sys.argv[5])
