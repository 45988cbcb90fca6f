"""Manifests: what a snapshot holds, so a reader can check every tensor it pulled.

A snapshot is one contiguous buffer of tensors laid end to end (each at an offset aligned
to `ALIGN` bytes) and its `Manifest`: per tensor its name, dtype (numpy's name, e.g.
`float32`), shape, offset, byte count and checksum (xxh3-64 of its bytes, hex). The
manifest's `digest()` (sha256 of its canonical JSON, hex) names the snapshot in the bus
events that announce it (`weights.published`, `contribution.returned`), so a reader knows
it got the manifest the event meant; `verify` then checks every tensor's bytes.

- `pack(tensors) -> (Manifest, bytearray)`: tensors (numpy arrays, any shape, C order
  after copy) in name order.
- `unpack(manifest, buffer) -> {name: ndarray}`: zero-copy views into `buffer`.
- `verify(manifest, buffer)`: raises ManifestError naming the first tensor whose bytes do
  not match, or a buffer of the wrong length.
"""
from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping

import numpy as np
import orjson
import xxhash

ALIGN = 64
"""Byte alignment of each tensor in a snapshot buffer."""


class ManifestError(ValueError):
    """A manifest is malformed, or a buffer does not match it (the message names the tensor)."""


@dataclasses.dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of a snapshot. dtype: numpy dtype name (`float32`, `float64`, `int64`, ...);
    shape: dims; offset, nbytes: its bytes in the buffer; checksum: xxh3-64 hex of them."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    checksum: str


@dataclasses.dataclass(frozen=True, slots=True)
class Manifest:
    """The tensors of one snapshot, in buffer order; total_bytes: the buffer's length."""

    entries: tuple[TensorEntry, ...]
    total_bytes: int

    def to_json(self) -> bytes:
        """Canonical JSON (the bytes `digest` hashes)."""
        return orjson.dumps({"total_bytes": self.total_bytes,
                             "entries": [dataclasses.asdict(e) for e in self.entries]})

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        """Raises ManifestError for anything that is not a well-formed manifest."""
        try:
            obj = orjson.loads(data)
            entries = tuple(TensorEntry(name=str(e["name"]), dtype=str(e["dtype"]),
                                        shape=tuple(int(d) for d in e["shape"]), offset=int(e["offset"]),
                                        nbytes=int(e["nbytes"]), checksum=str(e["checksum"]))
                            for e in obj["entries"])
            manifest = cls(entries=entries, total_bytes=int(obj["total_bytes"]))
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ManifestError(f"malformed manifest: {exc!r}") from None
        manifest.check()
        return manifest

    def digest(self) -> str:
        """sha256 hex of `to_json()`."""
        return hashlib.sha256(self.to_json()).hexdigest()

    def check(self) -> None:
        """Entries lie inside the buffer, do not overlap, and agree with dtype × shape."""
        end = 0
        for e in self.entries:
            try:
                itemsize = np.dtype(e.dtype).itemsize
            except TypeError:
                raise ManifestError(f"tensor {e.name!r}: unknown dtype {e.dtype!r}") from None
            if e.nbytes != itemsize * int(np.prod(e.shape, dtype=np.int64)) or e.offset < end or e.nbytes < 0:
                raise ManifestError(f"tensor {e.name!r}: offset {e.offset} / {e.nbytes} bytes do not fit "
                                    f"{e.dtype}{list(e.shape)} after byte {end}")
            end = e.offset + e.nbytes
        if end > self.total_bytes:
            raise ManifestError(f"tensors end at byte {end}, past the buffer's {self.total_bytes}")

    def names(self) -> list[str]:
        return [e.name for e in self.entries]


def checksum(data: memoryview | bytes) -> str:
    """xxh3-64 hex of `data`."""
    return xxhash.xxh3_64_hexdigest(data)


def pack(tensors: Mapping[str, np.ndarray]) -> tuple[Manifest, bytearray]:
    """Lay `tensors` end to end (name order) in one buffer; returns its manifest and the buffer."""
    arrays = {name: np.ascontiguousarray(tensors[name]) for name in sorted(tensors)}
    offsets, end = {}, 0
    for name, a in arrays.items():
        end = -(-end // ALIGN) * ALIGN
        offsets[name] = end
        end += a.nbytes
    buf = bytearray(end)
    view = memoryview(buf)
    entries = []
    for name, a in arrays.items():
        off = offsets[name]
        raw = memoryview(a.reshape(-1).view(np.uint8)) if a.size else memoryview(b"")
        view[off:off + a.nbytes] = raw
        entries.append(TensorEntry(name=name, dtype=a.dtype.name, shape=tuple(int(d) for d in a.shape), offset=off,
                                   nbytes=a.nbytes, checksum=checksum(view[off:off + a.nbytes])))
    return Manifest(entries=tuple(entries), total_bytes=end), buf


def verify(manifest: Manifest, buffer: bytes | bytearray | memoryview) -> None:
    """Check `buffer` against every checksum of `manifest`. Raises ManifestError."""
    view = memoryview(buffer)
    if len(view) != manifest.total_bytes:
        raise ManifestError(f"buffer holds {len(view)} bytes, the manifest {manifest.total_bytes}")
    for e in manifest.entries:
        got = checksum(view[e.offset:e.offset + e.nbytes])
        if got != e.checksum:
            raise ManifestError(f"tensor {e.name!r}: checksum {got} != manifest's {e.checksum}")


def unpack(manifest: Manifest, buffer: bytearray | memoryview) -> dict[str, np.ndarray]:
    """{name: array} viewing `buffer` (no copy; writable when the buffer is)."""
    out = {}
    for e in manifest.entries:
        out[e.name] = np.frombuffer(buffer, dtype=np.dtype(e.dtype), count=int(np.prod(e.shape, dtype=np.int64)),
                                    offset=e.offset).reshape(e.shape)
    return out
