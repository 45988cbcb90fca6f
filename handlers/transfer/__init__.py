"""Transfer backends that run servers or threads (DESIGN.md "Code layout"): `loopback` (a
TCP socket on 127.0.0.1) and `mooncake` (Mooncake's transfer engine). `make_backend` picks
one from the recipe's `[cells]` transfer keys."""
from __future__ import annotations

from gyre.transfer.interface import TransferBackend


def make_backend(kind: str, *, host: str = "127.0.0.1", lease_s: float = 30.0, protocol: str = "tcp",
                 cluster: bool = False) -> TransferBackend:
    """A process's backend of `kind` (`loopback` or `mooncake`). Raises
    handlers.transfer.mooncake.MooncakeUnavailable where Mooncake cannot run (it says why)."""
    if kind == "loopback":
        from handlers.transfer.loopback import LoopbackTransfer

        return LoopbackTransfer(host=host, lease_s=lease_s)
    if kind == "mooncake":
        from handlers.transfer.mooncake import MooncakeTransfer

        return MooncakeTransfer(host=host, lease_s=lease_s, protocol=protocol, cluster=cluster)
    raise ValueError(f"unknown transfer backend {kind!r}: loopback or mooncake")
