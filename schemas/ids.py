"""Event ids (DESIGN.md "Event ids"): one id per fact, sent as `Nats-Msg-Id`; the only
place that builds them. Each is deterministic in its arguments except `announce`, which
names a cell's start by the wall-clock time it happened."""
from __future__ import annotations

import hashlib
import time


def dispatched(run: str, execution: str) -> str:
    return f"{run}:{execution}:dispatched"


def started(run: str, execution: str) -> str:
    return f"{run}:{execution}:started"


def finished(run: str, execution: str) -> str:
    return f"{run}:{execution}:finished"


def scored(run: str, execution: str, attempt: int) -> str:
    return f"{run}:{execution}:scored:{attempt}"


def call(run: str, execution: str, seq: int) -> str:
    return f"{run}:{execution}:call:{seq}"


def microstep(run: str, step: int, index: int) -> str:
    return f"{run}:step:{step}:mstep:{index}"


def sealed(run: str, step: int) -> str:
    return f"{run}:step:{step}:sealed"


def step_completed(run: str, step: int) -> str:
    return f"{run}:step:{step}:completed"


def route(run: str, seq: int) -> str:
    return f"{run}:route:{seq}"


def switch(run: str, cell: str, seq: int) -> str:
    return f"{run}:cell:{cell}:switch:{seq}"


def switched(run: str, cell: str, seq: int) -> str:
    return f"{run}:cell:{cell}:switched:{seq}"


def kv_offered(run: str, cell: str, seq: int, keys: tuple[str, ...]) -> str:
    """`cell`'s offer of KV blocks in its switch `seq`, named also by the snapshot keys it
    offers (a switch redone after a failure exposes new snapshots: another fact)."""
    covered = hashlib.blake2b("\n".join(keys).encode(), digest_size=6).hexdigest()
    return f"{run}:cell:{cell}:kv:{seq}:offered:{covered}"


def kv_pulled(run: str, cell: str, offer: str, execution: str) -> str:
    """`cell` is done with the block of `execution` in the offer `offer` (its event id)."""
    return f"{run}:cell:{cell}:kv:{offer}:{execution}:pulled"


def weights(run: str, version: int, epoch: int) -> str:
    """The weights of `version` published by the core of `epoch` (a restarted core publishes
    the version it resumed from again, under its own epoch)."""
    return f"{run}:weights:{version}:{epoch}"


def granted(run: str, epoch: int, step: int, index: int, grant: int) -> str:
    """The `grant`-th grant (from 1) of micro-step `index` of `step` by the core of `epoch`."""
    return f"{run}:core:{epoch}:step:{step}:mstep:{index}:granted:{grant}"


def committed(run: str, epoch: int, step: int, index: int) -> str:
    return f"{run}:core:{epoch}:step:{step}:mstep:{index}:committed"


def contribution(run: str, epoch: int, step: int, replica: str, microsteps: tuple[int, ...]) -> str:
    """A replica's contribution to `step` under the core of `epoch`, covering `microsteps`.

    DESIGN.md spells it without the ids; they are part of it because a replica can return a
    second contribution to the same step (it left training and came back, or it restarted,
    or its first was refused and its ids granted again), which is another fact, not a
    duplicate to drop. A repeat of the same contribution keeps its id."""
    covered = hashlib.blake2b(",".join(map(str, sorted(microsteps))).encode(), digest_size=6).hexdigest()
    return f"{run}:core:{epoch}:step:{step}:contribution:{replica}:{covered}"


def step_failed(run: str, epoch: int, step: int) -> str:
    return f"{run}:core:{epoch}:step:{step}:failed"


def claim(run: str, replica: str, seq: int) -> str:
    """A replica's `seq`-th claim request (never stored; it names the request in logs)."""
    return f"{run}:claim:{replica}:{seq}"


def loaded(run: str, cell: str, version: int, epoch: int, role: str = "rollout") -> str:
    """`cell` verified and loaded the weights of `version` published by the core of `epoch`:
    into its engine (`rollout`), or into its trainer as a satellite (`training`, a fact of its
    own: a cell may do both with one version, and the engine's load must not be taken for a
    duplicate of the trainer's)."""
    base = f"{run}:cell:{cell}:loaded:{version}:{epoch}"
    return base if role == "rollout" else f"{base}:{role}"


def announce(run: str, cell: str, now_s: float | None = None) -> str:
    """A cell's announcement of its role at start (a `cell.switched` with no switch behind it).
    now_s: Unix time in seconds (default now); the id holds it in whole microseconds, so a
    restarted cell announces anew."""
    return f"{run}:cell:{cell}:announce:{int((time.time() if now_s is None else now_s) * 1e6)}"


def dead_letter(stream: str, stream_seq: int) -> str:
    """The dead-letter copy of message `stream_seq` of `stream` (a full stream name, which
    holds the run): a redelivered poison message is dead-lettered once."""
    return f"dlq:{stream}:{stream_seq}"


def dead_letter_of(event_id: str) -> str:
    """The dead-letter copy of event `event_id` made by its producer's consumer downstream
    (`Bus.dead_letter`; e.g. a micro-step that failed its step)."""
    return f"dlq:{event_id}"
