"""The one place that spells subjects, streams and durable consumers.

Subjects: `gyre.v1.<run>.<name>`; dead letters `gyre.v1.<run>.dlq.<name>`.
Streams: `GYRE_<RUN>_<CONCERN>` (file storage, limits retention). Consumers: one
durable per handler per major version (`builder-v1`), and one per cell (`cell_consumer`).
Event names come from the schemas' `NAME`s.
"""
from __future__ import annotations

import dataclasses
import re

from schemas import (
    CallCompleted,
    CellSwitch,
    CellSwitched,
    KvOffered,
    KvPulled,
    ExecutionDispatched,
    ExecutionFinished,
    ExecutionScored,
    ExecutionStarted,
    ContributionReturned,
    MicrostepCommitted,
    MicrostepGranted,
    MicrostepReady,
    RouteUpdated,
    StepCompleted,
    StepFailed,
    StepSealed,
    WeightsLoaded,
    WeightsPublished,
)

PREFIX = "gyre.v1"
_RUN_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def check_run(run: str) -> str:
    """Validate a run id (letters, digits, '-', '_'; ≤ 64 chars). Raises ValueError."""
    if not _RUN_RE.match(run):
        raise ValueError(f"run id {run!r} must match {_RUN_RE.pattern}")
    return run


def subject(run: str, name: str) -> str:
    """Subject of event `name` (e.g. 'call.completed') in `run`."""
    return f"{PREFIX}.{check_run(run)}.{name}"


def dlq_subject(run: str, name: str) -> str:
    """Dead-letter subject for undecodable or invalid events of `name`."""
    return f"{PREFIX}.{check_run(run)}.dlq.{name}"


def run_wildcard(run: str | None) -> str:
    """Everything of one run, or of every run when `run` is None (for `gyre tap`)."""
    return f"{PREFIX}.*.>" if run is None else f"{PREFIX}.{check_run(run)}.>"


def name_of(subj: str) -> str:
    """Inverse of `subject`: 'gyre.v1.r1.call.completed' → 'call.completed'."""
    parts = subj.split(".", 3)
    if len(parts) < 4 or f"{parts[0]}.{parts[1]}" != PREFIX:
        raise ValueError(f"not a gyre subject: {subj!r}")
    return parts[3]


def run_of(subj: str) -> str:
    return subj.split(".", 3)[2]


@dataclasses.dataclass(frozen=True, slots=True)
class StreamSpec:
    """A JetStream stream of one run: `names` are event names it captures.

    work_queue: work-queue retention (each message consumed once), else limits.
    max_age_s: seconds messages are kept; max_bytes: size cap (-1 = none).
    duplicate_window_s: seconds within which a repeated Nats-Msg-Id is dropped as a duplicate.
    """

    concern: str
    names: tuple[str, ...]
    work_queue: bool = False
    max_age_s: float = 7 * 24 * 3600.0
    max_bytes: int = -1
    duplicate_window_s: float = 120.0

    def stream_name(self, run: str) -> str:
        return f"GYRE_{check_run(run).upper().replace('-', '_')}_{self.concern}"

    def subjects(self, run: str) -> list[str]:
        return [subject(run, n) for n in self.names]


CALLS_DUPLICATE_WINDOW_S = 1200.0
"""The CALLS stream's duplicate window (seconds): longer than any publish of one
`call.completed` is retried (`gyre.config.ProxySection.retry_timeout_s` is checked against it)."""

STREAMS: tuple[StreamSpec, ...] = (
    StreamSpec("EXECUTIONS", (ExecutionStarted.NAME, ExecutionFinished.NAME, ExecutionScored.NAME)),
    StreamSpec("DISPATCH", (ExecutionDispatched.NAME,), work_queue=True),
    # The proxy retries a call's publish for up to its retry_timeout_s (600 s) after an
    # attempt whose PubAck may have been lost: a duplicate must still be recognised then.
    StreamSpec("CALLS", (CallCompleted.NAME,), duplicate_window_s=CALLS_DUPLICATE_WINDOW_S),
    # Kept until their step completes (the core's ledger replays them after a restart):
    # limits retention, never a work queue that deletes on ack.
    StreamSpec("MICROSTEPS", (MicrostepReady.NAME,)),
    StreamSpec("STEPS", (StepSealed.NAME, StepCompleted.NAME, WeightsPublished.NAME, StepFailed.NAME,
                          WeightsLoaded.NAME)),
    StreamSpec("LEDGER", (MicrostepGranted.NAME, MicrostepCommitted.NAME, ContributionReturned.NAME)),
    StreamSpec("CELLS", (CellSwitch.NAME, CellSwitched.NAME, RouteUpdated.NAME, KvOffered.NAME, KvPulled.NAME)),
    StreamSpec("DLQ", ("dlq.>",)),
)


@dataclasses.dataclass(frozen=True, slots=True)
class ConsumerSpec:
    """A durable pull consumer. `names` filter the stream's subjects.

    ack_wait_s: seconds before an unacked message is redelivered.
    max_ack_pending: backpressure knob: unacked messages outstanding at most.
    max_deliver: deliveries before the server gives up (-1 = forever).
    """

    durable: str
    stream: str
    names: tuple[str, ...]
    ack_wait_s: float = 30.0
    max_ack_pending: int = 1000
    max_deliver: int = -1


CONSUMERS: tuple[ConsumerSpec, ...] = (
    ConsumerSpec("runner-v1", "DISPATCH", (ExecutionDispatched.NAME,), ack_wait_s=60.0, max_ack_pending=64),
    ConsumerSpec("builder-v1", "EXECUTIONS", (ExecutionStarted.NAME, ExecutionScored.NAME)),
    ConsumerSpec("builder-calls-v1", "CALLS", (CallCompleted.NAME,)),
    ConsumerSpec("evaluator-v1", "EXECUTIONS", (ExecutionFinished.NAME,), ack_wait_s=120.0, max_ack_pending=8),
    ConsumerSpec("scheduler-v1", "EXECUTIONS", (ExecutionStarted.NAME, ExecutionFinished.NAME, ExecutionScored.NAME)),
    ConsumerSpec("scheduler-steps-v2", "STEPS", (StepSealed.NAME, StepCompleted.NAME, WeightsLoaded.NAME)),
    ConsumerSpec("scheduler-cells-v1", "CELLS", (CellSwitched.NAME,)),
    ConsumerSpec("scheduler-microsteps-v1", "MICROSTEPS", (MicrostepReady.NAME,)),
    ConsumerSpec("scheduler-ledger-v1", "LEDGER", (MicrostepGranted.NAME, MicrostepCommitted.NAME)),
    # The core pulls and adds each contribution before it acks; a redelivery is a duplicate
    # the ledger counts once.
    ConsumerSpec("core-contributions-v1", "LEDGER", (ContributionReturned.NAME,), ack_wait_s=120.0,
                 max_ack_pending=16),
)
"""The durables of one run, created by `Bus.ensure_streams` at every daemon's start."""

CELL = "<cell>"
"""Placeholder for a cell id in the durable name of a `CONSUMER_TEMPLATES` entry."""

CELL_CONSUMER = ConsumerSpec(f"{CELL}-v1", "CELLS", (CellSwitch.NAME,), ack_wait_s=120.0, max_ack_pending=1)
"""Each cell's own durable of `cell.switch` (`cell0-v1`): every cell sees every switch and
takes one at a time. Created by the cell itself (`Bus.ensure_consumer(cell_consumer(cell))`),
since the run's cells are known only to them."""

CONSUMER_TEMPLATES: tuple[ConsumerSpec, ...] = (CELL_CONSUMER,)
"""Durables made once per cell; their names hold the `CELL` placeholder."""


def cell_consumer(cell: str) -> ConsumerSpec:
    """The durable consumer of cell `cell` (`CELL_CONSUMER` with its id filled in)."""
    return dataclasses.replace(CELL_CONSUMER, durable=CELL_CONSUMER.durable.replace(CELL, cell))


def stream_for(name: str) -> StreamSpec:
    """The stream spec capturing event `name`. Raises KeyError."""
    for spec in STREAMS:
        if name in spec.names:
            return spec
    if name.startswith("dlq."):
        return STREAMS[-1]
    raise KeyError(f"no stream captures {name!r}")


def stream(concern: str) -> StreamSpec:
    """The stream spec of `concern` (e.g. 'CELLS'). Raises KeyError."""
    for spec in STREAMS:
        if spec.concern == concern:
            return spec
    raise KeyError(f"no stream with concern {concern!r}")


def consumer(durable: str) -> ConsumerSpec:
    for spec in CONSUMERS:
        if spec.durable == durable:
            return spec
    raise KeyError(f"no consumer named {durable!r}")


def object_bucket(run: str) -> str:
    """Object-store bucket of a run (micro-steps, large token arrays)."""
    return f"GYRE_{check_run(run).upper().replace('-', '_')}_OBJECTS"


def _consumer_entry(c: ConsumerSpec, run: str) -> dict:
    return {"durable": c.durable, "stream": stream(c.stream).stream_name(run),
            "filter_subjects": [subject(run, n) for n in c.names], "ack_policy": "explicit",
            "ack_wait_s": c.ack_wait_s, "max_ack_pending": c.max_ack_pending, "max_deliver": c.max_deliver}


def catalogue(run: str = "RUN") -> dict:
    """Streams and durable consumers of one run as plain data (mirrored in ops/nats/).

    `run` is substituted everywhere; ops/nats/catalogue.json uses the placeholder "RUN".
    `consumer_templates` are made once per cell, `<cell>` standing for the cell id.
    """
    return {
        "subject_prefix": f"{PREFIX}.{run}",
        "streams": [
            {"name": s.stream_name(run), "subjects": s.subjects(run),
             "retention": "workqueue" if s.work_queue else "limits", "storage": "file",
             "max_age_s": s.max_age_s, "max_bytes": s.max_bytes, "duplicate_window_s": s.duplicate_window_s}
            for s in STREAMS
        ],
        "consumers": [_consumer_entry(c, run) for c in CONSUMERS],
        "consumer_templates": [_consumer_entry(c, run) for c in CONSUMER_TEMPLATES],
        "object_store": object_bucket(run),
        "dead_letters": dlq_subject(run, "<name>"),
    }


if __name__ == "__main__":
    import json
    import sys

    json.dump(catalogue(sys.argv[1] if len(sys.argv) > 1 else "RUN"), sys.stdout, indent=2)
    print()
