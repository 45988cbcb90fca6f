"""The proxy's call journal: each call's `call.completed` is written to a file before its
answer goes out, so that a proxy killed (SIGKILL, OOM) after answering a harness and
before JetStream acknowledged the call's record does not lose it; the run's next proxy
publishes what the journal holds before it serves (`handlers.proxy.restart.resume`).

Contract:
- Files: segments `<prefix>.<n>.jsonl` (`Config.journal`; a run's proxy uses
  `<run_dir>/proxy-journal`), lines in the spill file's format (`{"event":
  <call.completed>, "tokens": <token arrays' JSON or null>}`), each written whole by one
  `write(2)` and not fsynced: it survives the process's death (the kernel holds it), not
  the machine's (a reboot kills the harness too: `gyre run --resume` scores such an
  execution on its workspace).
- `write(event_id, line)`: appends to the current segment; the id is pending until
  `done(event_id)` (acknowledged by JetStream, or spilled: the spill file is fsynced). A
  call written again (an `ok` answer whose delivery was then cut: `aborted`) has its last
  line count (`read`).
- A segment over `SEGMENT_BYTES` is closed and a new one started; a closed segment with
  nothing pending is removed at once; `close()` removes every segment with nothing
  pending (a clean stop leaves none: its drain acknowledged or spilled every call).
- `read(prefix)`: the events of every segment left by an earlier proxy, oldest first, the
  last line per event id, a line cut short by a kill mid-write skipped (its answer had not
  gone out); the reader deletes those segments once their calls are published.
Cost: one `write(2)` of the event's JSON per call, on the event loop, before the answer.
Errors: a segment that cannot be opened or written is logged (`proxy.journal.failed`) and
the call served without it (the journal is a guard against a kill, not a precondition of
serving); nothing here raises on the hot path.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import orjson
import structlog

log = structlog.get_logger()

SEGMENT_BYTES = 8 << 20
"""A segment is closed, and a new one started, once it holds this many bytes: a closed
segment is removed as soon as its last call is acknowledged, so the journal holds little
more than the calls awaiting their PubAck."""


def segments(prefix: str | Path) -> list[Path]:
    """The segment files of `prefix`, oldest first."""
    prefix = Path(prefix)
    pattern = re.compile(re.escape(prefix.name) + r"\.(\d+)\.jsonl")
    found = [(int(m.group(1)), p) for p in prefix.parent.glob(prefix.name + ".*.jsonl")
             if (m := pattern.fullmatch(p.name))]
    return [p for _, p in sorted(found)]


def read(prefix: str | Path) -> tuple[list[dict], list[Path]]:
    """(each journaled call left by an earlier proxy, as `{"event": ..., "tokens": ...}`
    (JSON values), the last line per event id, in the order of their first lines; the
    segments read). Lines cut short or unreadable are skipped (logged)."""
    latest: dict[str, dict] = {}
    paths = segments(prefix)
    for path in paths:
        for line in path.read_bytes().splitlines():
            if not line.strip():
                continue
            try:
                item = orjson.loads(line)
                event_id = item["event"]["event_id"]
            except (orjson.JSONDecodeError, KeyError, TypeError):
                log.warning("proxy.journal.line_skipped", journal=str(path), line=line[:200],
                            hint="cut short by a kill mid-write: its answer had not gone out")
                continue
            latest[event_id] = item
    return list(latest.values()), paths


class Journal:
    """The journal this proxy writes (see the module's contract). prefix: `Config.journal`."""

    def __init__(self, prefix: str | Path, segment_bytes: int = SEGMENT_BYTES) -> None:
        self.prefix = Path(prefix)
        self.segment_bytes = segment_bytes
        existing = segments(self.prefix)
        self._n = int(existing[-1].name.rsplit(".", 2)[-2]) + 1 if existing else 0
        self._fd: int | None = None
        self._size = 0
        self._pending: dict[int, set[str]] = {}
        """segment number → event ids written there and not yet done."""

    def _path(self, n: int) -> Path:
        return self.prefix.with_name(f"{self.prefix.name}.{n}.jsonl")

    def write(self, event_id: str, line: bytes) -> None:
        """Append `line` (one JSON object, no newline) for `event_id`: pending until `done`."""
        try:
            if self._fd is None or self._size >= self.segment_bytes:
                self._rotate()
            data = line + b"\n"
            written = os.write(self._fd, data)
            while written < len(data):  # (a regular file takes it whole; a full disk says so)
                written += os.write(self._fd, data[written:])
            self._size += len(data)
            self._pending[self._n].add(event_id)
        except OSError as exc:
            log.error("proxy.journal.failed", journal=str(self._path(self._n)), error=repr(exc), event_id=event_id,
                      hint="this call's record is lost if the proxy is killed before JetStream acknowledges it")

    def done(self, event_id: str) -> None:
        """`event_id` is acknowledged or spilled: a closed segment left with nothing pending is removed."""
        for n in [n for n, ids in self._pending.items() if event_id in ids]:
            ids = self._pending[n]
            ids.discard(event_id)
            if not ids and n != self._n:
                del self._pending[n]
                self._path(n).unlink(missing_ok=True)

    def _rotate(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            if not self._pending.get(self._n):
                self._pending.pop(self._n, None)
                self._path(self._n).unlink(missing_ok=True)
            self._n += 1
        self._fd = os.open(self._path(self._n), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._size = 0
        self._pending[self._n] = set()

    def pending(self) -> int:
        """Calls written and not yet done."""
        return sum(len(ids) for ids in self._pending.values())

    def close(self) -> None:
        """Close the current segment and remove every segment with nothing pending."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        for n, ids in list(self._pending.items()):
            if not ids:
                del self._pending[n]
                self._path(n).unlink(missing_ok=True)
        if self._pending:
            log.warning("proxy.journal.left", calls=self.pending(), hint="the run's next proxy publishes them")
