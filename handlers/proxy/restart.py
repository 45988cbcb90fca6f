"""What a (re)starting proxy does before it serves, and what a serving one does with the
calls it could not publish.

Contract (one proxy serves a run):
- `run_lock(path, run)`: a proxy holds an exclusive lock beside its run's url file for
  its whole life, its drain and spill included; a second proxy of the run does not start
  while it is held (FatalError naming the holder's pid). Nor while the proxy named in the
  url file answers `/health` for the same run (`handlers.proxy.daemon.run`).
- `resume(state, bus, stop)`: before serving, publishes what an earlier proxy spilled or
  journaled (it was killed before JetStream acknowledged those calls) and is not stored
  already, then reads the ids of the run's stored `call.completed` events
  (headers only) and continues each execution's seq after its highest, so event ids never
  repeat. A restarted proxy's call stores are empty, so each execution's next call is a
  new root (its full prompt in the event). `max_calls` counts each execution's stored
  calls as started, but for its count_tokens calls (their `call.completed` carries the
  header `Gyre-Request-Kind: count_tokens`; an event stored before that header existed
  counts as a model call).
- `wait_for_replay(...)`: a proxy serves once its replay of the run's events
  (`handlers.proxy.state.REPLAYED`) has handled the history stored at its start.
- `resend_spilled(state, stop)`: while serving, what this proxy spilled is published once
  the bus takes events again (on reconnecting or the next acknowledged publish, else
  every `SPILL_RETRY_S`).
Errors: a proxy that cannot read the stored ids or publish its predecessor's calls does
not serve (`resume` raises what `Bus.stored_ids` and `Outbox.republish` raise).
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import structlog

from handlers.proxy.outbox import Outbox
from handlers.proxy.state import ProxyState
from schemas.call import CallCompleted

log = structlog.get_logger()

SPILL_RETRY_S = 2.0
"""How often a serving proxy tries to publish what it spilled when no publish has been
acknowledged since (`resend_spilled`): soon, so that a call spilled at the end of a burst
still lands before its execution is scored (each try itself waits for the bus, retrying
with backoff within `retry_timeout_s`)."""
SPILL_RETRY_MAX_S = 60.0
"""The longest wait between tries of `resend_spilled` while they keep failing (each reads
every stored call id of the run: seconds in a long run)."""


def run_lock(path: Path, run: str) -> Any:
    """Hold an exclusive lock on `path` (beside the run's url file) for this proxy's life,
    the kernel's `flock`, released when the file is closed or the process dies. A second
    proxy of the run is refused while the first still runs, also while it drains and
    spills after it stopped listening (then `/health` no longer answers): it would
    otherwise number calls before the first's spilled ones are published. Raises
    FatalError naming the holder's pid."""
    import fcntl

    from handlers.daemon import FatalError

    f = open(os.open(path, os.O_RDWR | os.O_CREAT, 0o600), "r+b")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = f.read().decode(errors="replace").strip() or "?"
        f.close()
        raise FatalError(f"a proxy of run {run} still runs (pid {holder}: serving, or finishing its calls after a "
                         f"stop; {path}); one proxy per run: start this one once that one has exited") from None
    f.truncate(0)
    f.write(str(os.getpid()).encode())
    f.flush()
    return f


async def _unless_stopped(coro: Awaitable[Any], stop: asyncio.Event) -> Any:
    """`coro`'s result, or None once `stop` is set (it is then cancelled: a publish may wait
    on a bus that is down for minutes). Raises what `coro` raises."""
    work, stopped = asyncio.ensure_future(coro), asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({work, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
    return None if work.cancelled() else work.result()


async def wait_for_replay(caught_up: asyncio.Event, replay: asyncio.Task, stop: asyncio.Event) -> bool:
    """Wait until the replay has handled the history stored at its start; False when `stop`
    comes first. Raises what the replay raised, should it end before."""
    t0 = time.monotonic()
    waits = {asyncio.ensure_future(caught_up.wait()), asyncio.ensure_future(stop.wait())}
    try:
        await asyncio.wait({*waits, replay}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
    if caught_up.is_set():
        log.info("proxy.replay.caught_up", seconds=round(time.monotonic() - t0, 3))
        return True
    if replay.done() and not stop.is_set():
        replay.result()  # its error
        raise RuntimeError("the proxy's replay of the run's events ended before it caught up")
    return False


async def resend_spilled(state: Outbox, stop: asyncio.Event) -> None:
    """While serving: publish what this proxy spilled once the bus takes events again
    (`Outbox.republish`: as soon as a publish is acknowledged after a spill or the
    connection is back, else every SPILL_RETRY_S while a spill file exists, backing off to
    SPILL_RETRY_MAX_S while the tries fail), so that a bus outage longer than
    `retry_timeout_s` delays calls without a restart, and they land before their
    executions' scores as far as possible. The run's stored call ids are read first and
    those calls left out: a spilled call whose PubAck alone was lost may be stored already,
    and past the duplicate window JetStream would store it again."""
    from bus.consumer import wait_any

    path = Path(state.cfg.spill_file) if state.cfg.spill_file else None
    wait_s = SPILL_RETRY_S
    if path is not None:  # a bus back after a long outage with no call to publish: do not wait out the backoff
        state.bus.on_reconnect(lambda: state.bus_back.set() if state.spilled else None)
    while path is not None and not stop.is_set():
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(wait_any([stop, state.bus_back]), wait_s)
        if stop.is_set():
            return
        state.bus_back.clear()
        if path.exists() or state.sending_path().exists():
            state.spilled = False
            try:
                known = await state.bus.stored_ids(CallCompleted.NAME, stop=stop)
                if known is None:  # stopped
                    return
                await state.republish(stop, known=set(known))
                wait_s = SPILL_RETRY_S
            except Exception as exc:  # noqa: BLE001 - kept on disk; tried again later and at the next start
                state.spilled = True
                # Each try reads every stored call id of the run: back off while it keeps failing.
                wait_s = min(wait_s * 2, SPILL_RETRY_MAX_S)
                log.warning("proxy.spill.republish_failed", error=repr(exc), retry_in_s=wait_s)


async def resume(state: ProxyState, bus: Any, stop: asyncio.Event) -> bool:
    """Before serving: publish what an earlier proxy spilled or journaled and is not stored
    already (`Outbox.republish`, `Outbox.republish_journal`: a spilled call whose PubAck alone was lost is not stored a
    second time, also after JetStream's duplicate window), then resume the executions'
    seqs from the run's stored `call.completed` ids, those included
    (`ProxyState.resume_seqs`). False when `stop` is set meanwhile (the proxy then never
    serves). Raises what `Bus.stored_ids` and `republish` raise: a proxy that cannot read
    the ids or publish its predecessor's calls must not serve."""
    t0 = time.monotonic()
    stored = await bus.stored_ids(CallCompleted.NAME, stop=stop)
    if stored is None or stop.is_set():
        return False
    published = await _unless_stopped(state.republish(stop, known=set(stored)), stop)
    if published is None or stop.is_set():
        return False
    journaled = await _unless_stopped(state.republish_journal(stop, known=set(stored) | set(published)), stop)
    if journaled is None or stop.is_set():
        return False
    published.update(journaled)
    log.info("proxy.seqs.resumed", executions=state.resume_seqs({**stored, **published}),
             calls=len(stored) + len(published), seconds=round(time.monotonic() - t0, 3))
    return True
