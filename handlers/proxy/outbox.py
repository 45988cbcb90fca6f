"""The proxy's `call.completed` outbox: every call's record, built, published in the
background, retried, spilled to a file when the bus will not take it, and published again.

Contract:
- `Outbox.call_event(...)` builds a call's `call.completed` (id
  `<run>:<execution>:call:<seq>`, `schemas.ids.call`): status `ok`, `aborted` (the client
  went away or the stop cancelled the call; a completion generated but not delivered is
  kept) or `error` (no completion). An event whose encoding exceeds
  `Config.object_threshold_bytes` carries its token arrays in the object store under
  `calls/<execution>/<seq>` (`tokens_key`; orjson `{"prompt_ids", "completion_ids",
  "logprobs"}`) and the key in `tokens_ref`. A count_tokens call goes with the header
  `Gyre-Request-Kind: count_tokens` (`call_headers`).
- `publish_later(out)` publishes in the background at once, at most
  `Config.max_publishes_in_flight` awaiting a PubAck; each is retried with backoff for up
  to `Config.retry_timeout_s` (at most `PUBLISH_RETRY_MAX_S`), then spilled.
- `spill(outs, why)` appends calls to `Config.spill_file` (JSON lines, fsynced);
  `republish(stop, known)` publishes them again (by this proxy once the bus takes events
  again, `handlers.proxy.restart.resend_spilled`; by the run's next proxy before it
  serves, `handlers.proxy.restart.resume`). Without a spill file a call that cannot be
  published is logged as lost.
- `journaled(out)` writes a call to the journal (`Config.journal`,
  `handlers.proxy.journal`) before its answer goes out; `publish_later` journals what is
  not yet, and a call leaves the journal once acknowledged or spilled.
  `republish_journal(stop, known)` publishes what an earlier proxy's journal holds (a
  proxy killed before its calls were acknowledged), before serving.
- `drain(timeout_s)` waits for the unacknowledged publishes within a bound, spills the
  rest, and cancels the other background work (`spawn`: upstream aborts).
Errors: `republish` raises RuntimeError when a spilled call is still not acknowledged
after `retry_timeout_s` (the files are kept); nothing else here raises on a bus failure.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time
from collections.abc import Awaitable, Set
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import orjson
import structlog

from bus.client import PayloadTooLarge
from bus.subjects import CALLS_DUPLICATE_WINDOW_S
from gyre.serving.roles import clean_meta
from gyre.serving.tito import Match
import schemas
from schemas import encode, ids
from schemas.call import CallCompleted, CallTokens, SamplingParams

from handlers.proxy import journal
from handlers.proxy.routing import EngineResult

if TYPE_CHECKING:
    from handlers.proxy.daemon import Config

log = structlog.get_logger()

PUBLISH_RETRY_MAX_S = CALLS_DUPLICATE_WINDOW_S - 180.0
"""Longest a `call.completed` publish is retried before it is spilled (`_publish`): within
the CALLS stream's duplicate window, less a bound on one `Bus.publish`'s own attempts, so
that a retry after an attempt whose PubAck alone was lost is still dropped as a duplicate."""

TOKEN_JSON_BYTES = 32
"""An upper bound on the JSON bytes of one token of `call.completed`: an id of ≤ 6 digits
and its comma, and for a sampled one its log-prob (a float as orjson writes it, ≤ 24
characters) and comma. Below `object_threshold_bytes / TOKEN_JSON_BYTES` tokens an
event's arrays are not measured before publishing (`Outbox._publish` still moves an
event that turns out too large)."""


def tokens_key(execution: str, seq: int) -> str:
    """Object-store key of a call's token arrays (`call.completed.tokens_ref`)."""
    return f"calls/{execution}/{seq}"


def _tokens_json(prompt_ids: Any, completion_ids: Any, logprobs: Any) -> bytes:
    """A call's token arrays as the object store keeps them (`CallTokens` as JSON); each a
    sequence or a 1-D numpy array."""
    return orjson.dumps({"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs},
                        option=orjson.OPT_SERIALIZE_NUMPY)


REQUEST_KIND_HEADER = "Gyre-Request-Kind"
"""The message header on a count_tokens call's `call.completed` (`call_headers`)."""


def call_headers(event: CallCompleted) -> dict[str, str]:
    """The headers `event` is published with beside its `Nats-Msg-Id`: `Gyre-Request-Kind:
    count_tokens` for a token count (an `auxiliary` call whose meta `request_kind` is
    `count_tokens`), which a restarted proxy does not count against `max_calls`
    (`handlers.proxy.state.ProxyState.resume_seqs`, reading headers only); none for every other call."""
    if event.role == "auxiliary" and event.meta.get("request_kind") == "count_tokens":
        return {REQUEST_KIND_HEADER: "count_tokens"}
    return {}


class Outgoing(NamedTuple):
    """A `call.completed` to publish, and the JSON of its token arrays when they go to the
    object store under `event.tokens_ref` (None: inline, or moved there at publish time if
    the event's encoding exceeds `object_threshold_bytes`)."""

    event: CallCompleted
    tokens_json: bytes | None = None


class Outbox:
    """The `call.completed` publishes of one proxy, and its other background work.

    cfg: the proxy's `Config` (run, spill_file, object_threshold_bytes, retry_timeout_s,
    retry_backoff_s, retry_backoff_max_s, max_publishes_in_flight). bus: a connected
    `bus.Bus` or None (nothing is published). `ProxyState` is an Outbox: the call path
    reaches `call_event` and `publish_later` on it without a further hop.
    """

    def __init__(self, cfg: Config, bus: Any = None):
        self.cfg = cfg
        self.bus = bus
        self._publishing = asyncio.Semaphore(cfg.max_publishes_in_flight)
        self._background: set[asyncio.Task] = set()
        self._unsent: dict[str, Outgoing] = {}
        """event id → each `call.completed` handed to `publish` and not yet acknowledged."""
        self._republished: set[str] = set()
        """Event ids of spilled calls this proxy has published again (`_republish_one`)."""
        self.spilled = False
        """Calls were spilled and not yet sent again (`handlers.proxy.restart.resend_spilled`)."""
        self.bus_back = asyncio.Event()
        """Set by an acknowledged publish while `spilled`: time to send the spilled calls."""
        self.journal = journal.Journal(cfg.journal) if cfg.journal and bus is not None else None
        """Where each call goes before its answer (`journaled`); None without a bus or `Config.journal`."""
        self._journaled: dict[str, tuple[CallCompleted, bytes]] = {}
        """event id → the event journaled and its encoding (kept for its publish), until published or spilled."""

    def spawn(self, coro: Awaitable[Any]) -> None:
        """Run `coro` in the background (a publish, an upstream abort); `drain` waits for it."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def publish_later(self, out: Outgoing) -> None:
        """`publish(out)` in the background, starting at once, the call counted unsent from
        now: a drain that cancels the publish before it has started still spills it. Not
        held back to batch with other calls: a call still in memory is lost in a crash, and
        one reaching the bus after its execution's score is never trained (the builder
        finalises a group once every execution is scored, and a scorer may answer within
        milliseconds). Calls answered in one loop step still go out in one nats-py flush.
        Journaled first (`journaled`) when it is not yet."""
        if self.bus is not None:
            if (cached := self._journaled.get(out.event.event_id)) is None or cached[0] is not out.event:
                out = self.journaled(out)
            self._unsent[out.event.event_id] = out
        self.spawn(self.publish(out))

    def journaled(self, out: Outgoing) -> Outgoing:
        """`out` written to the journal (one `write(2)`, not fsynced: a kill does not undo
        it), its encoding kept for the publish. Called before the answer's bytes go out, so
        that a proxy killed after the harness has its answer and before JetStream has its
        record leaves the record to its successor (`republish_journal`). Without a journal
        (no bus, no `Config.journal`), `out` unchanged."""
        if self.journal is None:
            return out
        event, data = _encoded(out.event)
        self.journal.write(event.event_id, orjson.dumps(
            {"event": orjson.Fragment(data),
             "tokens": orjson.Fragment(out.tokens_json) if out.tokens_json else None}))
        self._journaled[event.event_id] = (event, data)
        return Outgoing(event, out.tokens_json)

    def close_journal(self) -> None:
        """After `drain`: the journal's segments with nothing pending are removed."""
        if self.journal is not None:
            self.journal.close()

    async def drain(self, timeout_s: float) -> None:
        """Within timeout_s: wait until every `call.completed` handed to `publish` is
        acknowledged, spill those that are not (`Config.spill_file`) with up to a second of
        it left, give the other background work (upstream aborts) that second, then cancel
        it: a hung engine's abort does not hold the stop, and a kill soon after loses no
        call."""
        timeout_s = max(timeout_s, 0.0)
        deadline = time.monotonic() + timeout_s
        publishing_until = deadline - min(1.0, timeout_s / 4)
        while self._unsent and self._background and time.monotonic() < publishing_until:
            await asyncio.wait(set(self._background), timeout=publishing_until - time.monotonic(),
                               return_when=asyncio.FIRST_COMPLETED)
        if self._unsent:
            log.warning("proxy.drain.unfinished", unpublished=len(self._unsent))
            self.spill(list(self._unsent.values()), "shutdown")
            if self.journal is not None:
                for event_id in self._unsent:
                    self.journal.done(event_id)
                    self._journaled.pop(event_id, None)
            self._unsent.clear()  # spilled once: a publish cancelled below leaves it unsent
        if self._background:
            _, pending = await asyncio.wait(set(self._background), timeout=max(deadline - time.monotonic(), 0.01))
            for task in pending:
                task.cancel()
            if pending:
                log.info("proxy.drain.cancelled", tasks=len(pending))
                await asyncio.wait(pending, timeout=0.2)

    def call_event(self, *, execution: str, seq: int, match: Match, sampling: SamplingParams,
                   result: EngineResult | None, status: str, total_s: float, cell: str, api: str = "chat",
                   role: str = "main", meta: dict | None = None) -> Outgoing:
        """The `call.completed` event of a call, with its token arrays inline, or in the
        object store once their JSON alone exceeds `object_threshold_bytes` (written straight
        from the arrays, not from tuples of Python ints: the event loop's time).

        status `ok`: answered (without a result: a count_tokens call, finish `stop`).
        `aborted`: the harness went away (its completion, if one was generated but not
        delivered, is kept: it is still a sample of the policy). `error`: no engine
        answered, or it refused; no completion.
        """
        parent = match.parent
        prompt = match.new_prompt_ids  # (N,) int32
        completion = result.output_ids if result else []
        logprobs = result.logprobs if result else []
        tokens_json = tokens_ref = None
        if TOKEN_JSON_BYTES * (len(prompt) + len(completion)) > self.cfg.object_threshold_bytes:
            tokens_json = _tokens_json(prompt, completion, logprobs)
            if len(tokens_json) > self.cfg.object_threshold_bytes:
                tokens_ref = tokens_key(execution, seq)
            else:
                tokens_json = None
        tokens = CallTokens() if tokens_ref else CallTokens(
            prompt_ids=tuple(prompt.tolist()), completion_ids=tuple(completion), logprobs=tuple(logprobs))
        timings = {"total_s": round(total_s, 6)}
        if result:
            timings.update(queue_s=round(result.queue_s, 6), engine_s=round(result.engine_s, 6))
            finish = result.finish
        else:
            finish = {"ok": "stop", "aborted": "abort"}.get(status, "error")
        event = CallCompleted(
            event_id=ids.call(self.cfg.run, execution, seq), call=f"{execution}:{seq}", execution=execution,
            seq=seq, parent_call=parent.call if parent else None, prefix_len=match.prefix_len if parent else 0,
            tokens=tokens, tokens_ref=tokens_ref, sampling=sampling, finish_reason=finish,
            versions=result.versions if result else (), cell=cell, role=role, api=api, status=status,
            timings=timings, drift=match.drift, meta=dict(meta or {}),
        )
        return Outgoing(event, tokens_json)

    async def publish(self, out: Outgoing) -> None:
        """Publish `call.completed` (its token arrays first to the object store when they
        go there); retried with backoff for up to retry_timeout_s, then spilled to
        `Config.spill_file` (the call must not be lost). At most `max_publishes_in_flight`
        run at once."""
        if self.bus is None:
            return
        event_id = out.event.event_id
        self._unsent[event_id] = out
        async with self._publishing:
            stored = await self._publish(out)
        self._unsent.pop(event_id, None)  # (drain may have spilled it and cleared the map)
        if stored and self.spilled:
            self.bus_back.set()
        if not stored:  # (too large for the bus: the resend keeps it aside, `_republish_one`)
            self.spill([out], "no PubAck within retry_timeout_s" if stored is False else "too large for the bus")
        if self.journal is not None:  # acknowledged, or spilled (fsynced)
            self.journal.done(event_id)
            self._journaled.pop(event_id, None)

    def spill(self, outs: list[Outgoing], why: str) -> None:
        """Append calls that could not be published to `Config.spill_file` (one JSON line
        each: `{"event": <call.completed>, "tokens": <token arrays' JSON or null>}`, written
        and fsynced at once, after a newline: a line an earlier write left cut short stays
        apart, and one this write leaves is cut off again); without a spill file, or when it
        cannot be written, log them as lost."""
        event_ids = [out.event.event_id for out in outs]
        path = self.cfg.spill_file
        if path:
            lines = b"\n" + b"".join(orjson.dumps({"event": orjson.Fragment(_encoded(out.event)[1]),
                                                   "tokens": orjson.Fragment(out.tokens_json) if out.tokens_json
                                                   else None}) + b"\n" for out in outs)
            size = None
            try:
                with open(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "ab") as f:
                    size = f.seek(0, os.SEEK_END)
                    f.write(lines)  # all of it (os.write may write less)
                    f.flush()
                    os.fsync(f.fileno())
                self.spilled = True  # the next acknowledged publish sends them (`bus_back`)
                log.error("proxy.call.spilled", calls=len(outs), why=why, spill_file=path, event_ids=event_ids[:20],
                          hint="published once the bus takes events again, or by the run's next proxy")
                return
            except OSError as exc:
                log.error("proxy.spill.failed", spill_file=path, error=repr(exc))
                if size is not None:
                    with contextlib.suppress(OSError):
                        os.truncate(path, size)
        log.error("proxy.call.lost", calls=len(outs), why=why, event_ids=event_ids)

    async def republish(self, stop: asyncio.Event | None = None,
                        known: Set[str] = frozenset()) -> dict[str, dict[str, str]]:
        """Publish the calls spilled to `Config.spill_file` (by an earlier proxy: before
        serving, so that `resume_seqs` sees their ids; by this one: `handlers.proxy.restart.resend_spilled`), until
        neither it nor `sending_path()` is left. The file is first renamed to
        `sending_path()`, so that calls spilled meanwhile start a new one; a
        `sending_path()` left by an attempt that failed goes first. Returns the event ids
        published. An unreadable line (a write cut short), or one that can never be
        published (too large for the bus), is kept in `<spill_file>.unreadable` and logged. Raises RuntimeError when one is still not
        acknowledged after `retry_timeout_s`: the files are then kept (what went out
        meanwhile goes again, as a duplicate), and a starting proxy must not serve. Returns
        early, the files kept, once `stop` is set. known: event ids stored already, not
        published again. Returns each published event id with its headers (`call_headers`)."""
        published: dict[str, dict[str, str]] = {}
        if not self.cfg.spill_file or self.bus is None:
            return published
        while not (stop is not None and stop.is_set()):
            if not await self._republish_one(stop, known, published):
                break
        return published

    async def _republish_one(self, stop: asyncio.Event | None, known: Set[str],
                             published: dict[str, dict[str, str]]) -> bool:
        """One file's worth of `republish`, its event ids appended to `published`: False when
        no file was left (or `stop` came)."""
        path, sending = Path(self.cfg.spill_file), self.sending_path()
        if not sending.exists():
            try:  # new spills go to a fresh file meanwhile
                os.replace(path, sending)
            except FileNotFoundError:
                return False
        good, bad = [], []
        for line in sending.read_bytes().splitlines():
            if not line.strip():
                continue
            try:
                item = orjson.loads(line)
                event = schemas.decode(CallCompleted.NAME, item["event"])
                tokens = item["tokens"]
                good.append((line, event, orjson.dumps(tokens) if tokens is not None else None))
            except Exception as exc:  # noqa: BLE001 - kept aside, named in the log
                bad.append(line)
                log.error("proxy.spill.unreadable", spill_file=str(path), error=repr(exc), line=line[:200])
        good = [(line, event, tokens_json) for line, event, tokens_json in good
                if event.event_id not in known and event.event_id not in self._republished]
        for line, event, tokens_json in good:
            stored = await self._publish(Outgoing(event, tokens_json), may_have_landed=True, stop=stop)
            if stored is None:  # can never be published: kept aside like an unreadable line
                bad.append(line)
                continue
            if not stored:
                if stop is not None and stop.is_set():
                    return False
                raise RuntimeError(f"could not publish the calls spilled in {sending} (call {event.call}); "
                                   "is the bus up? the file is kept and tried again")
            # The file is kept whole when a later line fails: the next try must not send this
            # one again (long after JetStream's duplicate window, it would be stored twice).
            self._republished.add(event.event_id)
            published[event.event_id] = call_headers(event)
        if bad:
            with open(f"{path}.unreadable", "ab") as f:
                f.write(b"".join(line + b"\n" for line in bad))
        sending.unlink()
        log.warning("proxy.spill.republished", calls=len(good), unreadable=len(bad), spill_file=str(path))
        return True

    async def republish_journal(self, stop: asyncio.Event | None = None,
                                known: Set[str] = frozenset()) -> dict[str, dict[str, str]]:
        """Before serving: publish the calls an earlier proxy journaled and JetStream does not
        hold (`known`: stored event ids; it was killed before their PubAck), then remove
        their segments. A call journaled `ok` whose answer the kill cut short is published
        `ok` (the harness may retry it: one more sample). Returns each published event id
        with its headers; early, the segments kept, once `stop` is set. Raises RuntimeError
        when one is still not acknowledged after `retry_timeout_s` (the segments are kept)."""
        published: dict[str, dict[str, str]] = {}
        if not self.cfg.journal or self.bus is None:
            return published
        items, paths = journal.read(self.cfg.journal)
        for item in items:
            try:
                event = schemas.decode(CallCompleted.NAME, item["event"])
            except Exception as exc:  # noqa: BLE001 - named in the log; the others still go
                log.error("proxy.journal.unreadable", error=repr(exc), event=str(item["event"])[:200])
                continue
            if event.event_id in known or event.event_id in self._republished:
                continue
            tokens = item.get("tokens")
            out = Outgoing(event, orjson.dumps(tokens) if tokens is not None else None)
            stored = await self._publish(out, may_have_landed=True, stop=stop)
            if stored is None:  # can never be published: kept aside with the spilled calls
                self.spill([out], "too large for the bus")
                continue
            if not stored:
                if stop is not None and stop.is_set():
                    return published
                raise RuntimeError(f"could not publish the calls journaled in {paths} (call {event.call}); "
                                   "is the bus up? the journal is kept and tried again")
            self._republished.add(event.event_id)
            published[event.event_id] = call_headers(event)
        for path in paths:
            path.unlink(missing_ok=True)
        if paths:
            log.warning("proxy.journal.republished", calls=len(published), journaled=len(items),
                        segments=len(paths))
        return published

    def sending_path(self) -> Path:
        """Where `republish` moves the spill file while it publishes its calls."""
        return Path(f"{self.cfg.spill_file}.sending")

    async def _publish(self, out: Outgoing, may_have_landed: bool = False,
                       stop: asyncio.Event | None = None) -> bool | None:
        """True once stored (or known), False when still failing after retry_timeout_s (or
        once `stop` is set), None when the event can never be published (over the bus's
        payload limit even with its tokens in the object store). may_have_landed: an earlier attempt (a spilled call's) may be
        stored already, so a duplicate is no other proxy's doing."""
        deadline = time.monotonic() + min(self.cfg.retry_timeout_s, PUBLISH_RETRY_MAX_S)
        delay = self.cfg.retry_backoff_s
        event, tokens_json = out
        cached = self._journaled.get(event.event_id)
        encoded = cached[1] if cached is not None and cached[0] is event else None
        attempted = may_have_landed  # a publish attempt that failed may have landed
        ack_wait_s, one_publish_s = self.bus.config.timeout_s, self.bus.config.publish_bound_s()
        while True:
            try:
                event, data = (event, encoded) if encoded is not None else _encoded(event)
                if tokens_json is None and len(data) > self.cfg.object_threshold_bytes:
                    t = event.tokens  # inline arrays whose event is still too large with the rest
                    tokens_json = _tokens_json(t.prompt_ids, t.completion_ids, t.logprobs)
                    event = dataclasses.replace(event, tokens=CallTokens(),
                                                tokens_ref=tokens_key(event.execution, event.seq))
                    data = encode(event)
                encoded = data  # (a retry sends the same bytes)
                if tokens_json is not None:
                    await self.bus.put_object(event.tokens_ref, tokens_json)
                    log.debug("proxy.call.tokens_stored", event_id=event.event_id, tokens_ref=event.tokens_ref)
                again, attempted = attempted, True
                # One publish's own tries may outlast what is left of the window: bounded by it
                # then, but never below one PubAck wait (a slow PubAck on a healthy bus lands)
                left = max(deadline - time.monotonic(), ack_wait_s)
                async with asyncio.timeout(left if left < one_publish_s else None):
                    stored = await self.bus.publish(event, data, call_headers(event))
                if not stored and not again:
                    # Not our own earlier attempt landing: another proxy of this run used the id,
                    # and JetStream dropped this call.
                    log.error("proxy.call.duplicate_id", event_id=event.event_id, execution=event.execution,
                              call=event.call, hint="one proxy per run: start a replacement after the old one exited")
                return True
            except Exception as exc:  # noqa: BLE001 - keep trying within the bound; never drop silently
                clog = log.bind(event_id=event.event_id, execution=event.execution, call=event.call)
                if isinstance(exc, PayloadTooLarge):  # the same bytes again would fail again
                    clog.error("proxy.call.too_large", error=str(exc))
                    return None
                if stop is not None and stop.is_set():
                    return False
                if time.monotonic() + delay > deadline:
                    clog.error("proxy.call.publish_failed", error=repr(exc))
                    return False
                clog.warning("proxy.call.publish_retry", error=repr(exc), retry_in_s=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.cfg.retry_backoff_max_s)


def _encoded(event: CallCompleted) -> tuple[CallCompleted, bytes]:
    """(event, its bytes). An event holding a string that is not UTF-8 (a surrogate, which
    orjson refuses and no retry mends; `gyre.serving.roles.classify` cleans the metadata it takes
    from headers) is stored with its metadata escaped (`clean_meta`) rather than lost.
    Raises TypeError when it still does not encode."""
    try:
        return event, encode(event)
    except TypeError:
        log.warning("proxy.call.meta_escaped", event_id=event.event_id, hint="a metadata string was not UTF-8")
        event = dataclasses.replace(event, meta={k: clean_meta(v) if isinstance(v, str) else v
                                                 for k, v in event.meta.items()})
        return event, encode(event)
