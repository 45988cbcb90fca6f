"""The one place that spells subjects, streams and durable consumers.

Subjects: `gyre.v1.<run>.<name>`; dead letters `gyre.v1.<run>.dlq.<name>`.
Streams: `GYRE_<RUN>_<CONCERN>` (file storage, limits retention). Consumers: one
durable per handler per major version (`builder-v1`).
"""
from __future__ import annotations

import dataclasses
import re

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
`call.completed` is retried (`handlers.proxy.daemon.Config.retry_timeout_s` is checked against it)."""

STREAMS: tuple[StreamSpec, ...] = (
    StreamSpec("EXECUTIONS", ("execution.started", "execution.finished", "execution.scored")),
    StreamSpec("DISPATCH", ("execution.dispatched",), work_queue=True),
    # The proxy retries a call's publish for up to its retry_timeout_s (600 s) after an
    # attempt whose PubAck may have been lost: a duplicate must still be recognised then.
    StreamSpec("CALLS", ("call.completed",), duplicate_window_s=CALLS_DUPLICATE_WINDOW_S),
    StreamSpec("MICROSTEPS", ("microstep.ready",), work_queue=True),
    StreamSpec("STEPS", ("step.sealed", "step.completed", "weights.published")),
    StreamSpec("CELLS", ("cell.switch", "cell.switched", "route.updated")),
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
    ConsumerSpec("runner-v1", "DISPATCH", ("execution.dispatched",), ack_wait_s=60.0, max_ack_pending=64),
    ConsumerSpec("builder-v1", "EXECUTIONS", ("execution.started", "execution.scored")),
    ConsumerSpec("builder-calls-v1", "CALLS", ("call.completed",)),
    ConsumerSpec("evaluator-v1", "EXECUTIONS", ("execution.finished",), ack_wait_s=120.0, max_ack_pending=8),
    ConsumerSpec("scheduler-v1", "EXECUTIONS", ("execution.started", "execution.finished", "execution.scored")),
    ConsumerSpec("scheduler-steps-v1", "STEPS", ("step.sealed", "step.completed")),
    ConsumerSpec("scheduler-cells-v1", "CELLS", ("cell.switched",)),
    ConsumerSpec("trainer-v1", "MICROSTEPS", ("microstep.ready",), ack_wait_s=120.0, max_ack_pending=4),
)


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


def catalogue(run: str = "RUN") -> dict:
    """Streams and durable consumers of one run as plain data (mirrored in ops/nats/).

    `run` is substituted everywhere; ops/nats/catalogue.json uses the placeholder "RUN".
    """
    return {
        "subject_prefix": f"{PREFIX}.{run}",
        "streams": [
            {"name": s.stream_name(run), "subjects": s.subjects(run),
             "retention": "workqueue" if s.work_queue else "limits", "storage": "file",
             "max_age_s": s.max_age_s, "max_bytes": s.max_bytes, "duplicate_window_s": s.duplicate_window_s}
            for s in STREAMS
        ],
        "consumers": [
            {"durable": c.durable, "stream": stream(c.stream).stream_name(run),
             "filter_subjects": [subject(run, n) for n in c.names], "ack_policy": "explicit",
             "ack_wait_s": c.ack_wait_s, "max_ack_pending": c.max_ack_pending, "max_deliver": c.max_deliver}
            for c in CONSUMERS
        ],
        "object_store": object_bucket(run),
        "dead_letters": dlq_subject(run, "<name>"),
    }


if __name__ == "__main__":
    import json
    import sys

    json.dump(catalogue(sys.argv[1] if len(sys.argv) > 1 else "RUN"), sys.stdout, indent=2)
    print()
