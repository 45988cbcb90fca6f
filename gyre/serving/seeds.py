"""Per-call sampling seeds: what makes a run's samples independent of timing.

`call_seed(run_seed, execution, seq)` is the seed the proxy sends with a call's `/generate`
(SGLang's `sampling_params.seed`; the embedded engine seeds the call's own
`torch.Generator` with it). It depends only on the run's seed, the execution id and the
call's number within the execution, never on arrival order or on the other requests an
engine serves at the time, so the same recipe and seed sample the same tokens from the same
weights. A retried attempt of a call sends the same seed. Pure: no I/O.
"""
from __future__ import annotations

import hashlib

SEED_BITS = 63
"""Seeds lie in [0, 2**63): torch generators and SGLang take a non-negative int64."""


def call_seed(run_seed: int, execution: str, seq: int) -> int:
    """The sampling seed of call `seq` (0-based) of `execution` in a run seeded `run_seed`:
    the first 63 bits of BLAKE2b over the three values (distinct for distinct triples,
    up to hash collisions)."""
    digest = hashlib.blake2b(f"{int(run_seed)}\x00{execution}\x00{int(seq)}".encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> (64 - SEED_BITS)
