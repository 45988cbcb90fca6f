"""KV blocks: an execution's prefix KV cache as a snapshot that can move between engines.

DESIGN.md "Cells and engines": the embedded engine keeps, per execution, the KV cache of
its last call; when an execution is rerouted that cache moves with it. `KvBlocks` is that
cache cut into blocks of `block_tokens` positions per layer, keys and values apart, with
what a receiver must know to use it: the token ids the KV covers and the policy version of
the weights that computed it (a block of another version than the importing engine serves
is dropped, and the prefix recomputed).

`to_snapshot(blocks)` lays it out as named arrays for the transfer layer, so the snapshot's
manifest (gyre.transfer.manifest) covers every block, the ids and the version with a
checksum: `kv.ids` (int64), `kv.meta` (int64: version, block_tokens, layers),
`kv.<layer>.k.<block>` / `kv.<layer>.v.<block>` (batch 1, kv heads, ≤ block_tokens, head
dim). `from_snapshot(tensors)` is its inverse; it raises KvFormatError for anything else.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

import numpy as np

_BLOCK = re.compile(r"^kv\.(\d+)\.([kv])\.(\d+)$")


class KvFormatError(ValueError):
    """A snapshot that is not a well-formed set of KV blocks (the message says what)."""


@dataclasses.dataclass(frozen=True)
class KvBlocks:
    """One execution's prefix KV. ids: the token ids it covers (len = positions).
    version: policy version that computed it. keys, values: per layer, (1, heads, T, dim)
    arrays with T = len(ids)."""

    ids: tuple[int, ...]
    version: int
    keys: tuple[np.ndarray, ...]
    values: tuple[np.ndarray, ...]
    block_tokens: int = 64

    def __post_init__(self) -> None:
        if self.block_tokens < 1:
            raise KvFormatError(f"block_tokens must be >= 1, got {self.block_tokens}")
        if len(self.keys) != len(self.values):
            raise KvFormatError(f"{len(self.keys)} key layers but {len(self.values)} value layers")
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            if k.ndim != 4 or k.shape != v.shape or k.shape[2] != len(self.ids):
                raise KvFormatError(f"layer {i}: keys {k.shape} / values {v.shape} do not cover {len(self.ids)} ids")


def to_snapshot(blocks: KvBlocks) -> dict[str, np.ndarray]:
    """Named arrays for gyre.transfer (module docstring)."""
    out = {"kv.ids": np.asarray(blocks.ids, dtype=np.int64),
           "kv.meta": np.asarray([blocks.version, blocks.block_tokens, len(blocks.keys)], dtype=np.int64)}
    b = blocks.block_tokens
    for layer, (k, v) in enumerate(zip(blocks.keys, blocks.values)):
        for j, start in enumerate(range(0, len(blocks.ids), b)):
            out[f"kv.{layer}.k.{j}"] = np.ascontiguousarray(k[:, :, start:start + b])
            out[f"kv.{layer}.v.{j}"] = np.ascontiguousarray(v[:, :, start:start + b])
    return out


def from_snapshot(tensors: Mapping[str, np.ndarray]) -> KvBlocks:
    """The KvBlocks of `to_snapshot`'s arrays. Raises KvFormatError."""
    try:
        ids = tuple(int(i) for i in np.asarray(tensors["kv.ids"]).reshape(-1))
        version, block_tokens, layers = (int(x) for x in np.asarray(tensors["kv.meta"]).reshape(-1))
    except (KeyError, ValueError, TypeError) as exc:
        raise KvFormatError(f"not KV blocks: {exc!r}") from None
    parts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, arr in tensors.items():
        m = _BLOCK.match(name)
        if m:
            parts.setdefault((int(m.group(1)), m.group(2)), {})[int(m.group(3))] = arr
        elif name not in ("kv.ids", "kv.meta"):
            raise KvFormatError(f"unexpected tensor {name!r} in KV blocks")
    n_blocks = -(-len(ids) // block_tokens) if block_tokens > 0 else 0
    keys, values = [], []
    for layer in range(layers):
        for kind, into in (("k", keys), ("v", values)):
            got = parts.get((layer, kind), {})
            if sorted(got) != list(range(n_blocks)):
                raise KvFormatError(f"layer {layer} {kind}: blocks {sorted(got)}, expected {n_blocks}")
            into.append(np.concatenate([got[j] for j in range(n_blocks)], axis=2) if n_blocks else None)
    if len(parts) != 2 * layers:
        raise KvFormatError(f"blocks of {len(parts) // 2} layers, the metadata says {layers}")
    return KvBlocks(ids=ids, version=version, keys=tuple(keys), values=tuple(values), block_tokens=block_tokens)
