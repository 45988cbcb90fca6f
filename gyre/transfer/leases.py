"""Snapshot leases: when a snapshot's buffer may be freed (DESIGN.md "Weight publication").

Pure bookkeeping; the backend that owns the buffers (handlers/transfer/) passes the clock
(`now`: seconds on one monotonic clock).

- A reader `claim`s a snapshot before it pulls, under a lease of `lease_s` seconds that it
  `renew`s while it pulls; `release` says it confirmed or gave up. A lease that runs out
  counts as giving up (`expire`).
- The owner `withdraw`s a snapshot it no longer offers: no new claim is taken, and the
  buffer is `releasable` once no live claim remains. A name is never reused for other
  bytes while a claim on it is live (`expose` refuses).
"""
from __future__ import annotations

import dataclasses


class LeaseError(RuntimeError):
    """A claim on a snapshot that is not offered, or a name reused while it is held."""


@dataclasses.dataclass
class SnapshotLeases:
    """Claims per snapshot name (module docstring)."""

    offered: set[str] = dataclasses.field(default_factory=set)
    withdrawn: set[str] = dataclasses.field(default_factory=set)
    claims: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    """name → reader → lease end (seconds, the caller's clock)."""

    def expose(self, name: str, now: float) -> None:
        """Offer `name`. Raises LeaseError while a live claim holds an earlier snapshot of it."""
        self.expire(now)
        if self.claims.get(name):
            raise LeaseError(f"snapshot {name!r} is still held by {sorted(self.claims[name])}: not reused")
        self.withdrawn.discard(name)
        self.offered.add(name)

    def claim(self, name: str, reader: str, now: float, lease_s: float) -> None:
        """Raises LeaseError when `name` is not offered (never, or withdrawn)."""
        if name not in self.offered:
            raise LeaseError(f"snapshot {name!r} is not offered")
        self.claims.setdefault(name, {})[reader] = now + lease_s

    def renew(self, name: str, reader: str, now: float, lease_s: float) -> None:
        """Extend a live claim. Raises LeaseError when the reader holds none (it expired)."""
        held = self.claims.get(name, {})
        if held.get(reader, -1.0) < now:
            raise LeaseError(f"reader {reader!r} holds no live lease on {name!r}")
        held[reader] = now + lease_s

    def release(self, name: str, reader: str) -> None:
        """The reader confirmed or gave up (idempotent)."""
        held = self.claims.get(name)
        if held is not None:
            held.pop(reader, None)
            if not held:
                del self.claims[name]

    def expire(self, now: float) -> list[tuple[str, str]]:
        """Drop claims whose lease ended by `now`; returns them as (name, reader)."""
        gone = [(n, r) for n, held in self.claims.items() for r, until in held.items() if until <= now]
        for n, r in gone:
            self.release(n, r)
        return gone

    def withdraw(self, name: str) -> None:
        """Stop offering `name`; its buffer goes once no live claim remains."""
        self.offered.discard(name)
        self.withdrawn.add(name)

    def held(self, name: str, now: float) -> bool:
        """Whether a live claim holds `name`."""
        return any(until > now for until in self.claims.get(name, {}).values())

    def releasable(self, now: float) -> list[str]:
        """Withdrawn names no live claim holds (the owner frees them and forgets them)."""
        self.expire(now)
        out = sorted(n for n in self.withdrawn if not self.claims.get(n))
        self.withdrawn.difference_update(out)
        return out
