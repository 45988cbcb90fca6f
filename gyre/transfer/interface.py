"""The transfer interface every backend satisfies (loopback socket, Mooncake).

A backend belongs to one process. `expose(name, tensors)` offers a snapshot (weights of a
policy version, a replica's gradient sum) under a name unique to that process and returns
its `TransferRef` (`key`: where a reader finds it, `digest`: its manifest's digest);
`withdraw(name)` stops offering it (its buffer is freed once no reader holds a lease on
it: gyre.transfer.leases). `pull(ref, reader)` fetches a snapshot from any process,
checks that the manifest is the one `ref.digest` names and every tensor's checksum, and
returns the tensors; it raises TransferError for a failed, short, timed-out, cancelled
(its `cancel` event set) or corrupted transfer, so nothing unverified is ever returned. Blocking: async callers run it in a worker thread.
"""
from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping
from typing import Protocol

import numpy as np


class TransferError(RuntimeError):
    """A snapshot could not be pulled whole and verified (the message says why)."""


@dataclasses.dataclass(frozen=True, slots=True)
class TransferRef:
    """Where a snapshot is (`key`, backend-specific, e.g. `loopback://127.0.0.1:PORT/NAME`)
    and what it must be (`digest`: sha256 hex of its manifest)."""

    key: str
    digest: str


class TransferBackend(Protocol):
    def expose(self, name: str, tensors: Mapping[str, np.ndarray]) -> TransferRef: ...

    def withdraw(self, name: str) -> None: ...

    def pull(self, ref: TransferRef, reader: str, cancel: threading.Event | None = None) -> dict[str, np.ndarray]: ...

    def close(self) -> None: ...
