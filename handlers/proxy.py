"""Proxy daemon: the harness's model endpoint, with token-in/token-out capture.

Contract (DESIGN.md "Processes", "Token-in, token-out"):
- Routes: `POST /v1/chat/completions` (OpenAI Chat Completions; `stream` true/false;
  `tools`; `max_tokens`/`max_completion_tokens` capped at `Config.max_completion_tokens`
  (the cap when absent); `temperature`/`top_p`/`top_k` honoured and recorded, the
  Config defaults when absent; `stream_options.include_usage`; other fields such as
  `tool_choice`, `stop`, `user`, `metadata` ignored; `n` > 1 refused), `GET /v1/models`,
  `GET /health`, `GET|HEAD /`.
- Auth: `Authorization: Bearer <key>` or `x-api-key: <key>`, a per-execution key checked
  by `gyre.harness.verify_key`. Errors use OpenAI's shape
  `{"error": {"message", "type", "param": null, "code"}}`: 401 `authentication_error`
  (missing/invalid key), 400 `invalid_request_error` (malformed JSON or request),
  413 (body over `body_limit_bytes`), 400 code `max_calls_exceeded` once an execution
  has started `max_calls` calls — a non-retryable status, so every SDK gives up at once
  and the harness stops (429 would be retried). 502/503 `server_error` only when the
  engine refused the request or none was reachable within `retry_timeout_s`.
- Routing: sticky per execution. Rollout cells are learnt from `cell.switched`
  (`to_role` rollout with an `engine_url`; any other role removes the cell) and
  assignments from `route.updated`, both replayed from the bus. An execution without an
  assignment goes to the rollout cell with the fewest executions and sticks. With no
  cell known, `Config.engine_url` (cell `Config.static_cell`) serves. `execution.finished`
  (replayed too) frees an execution's call store. When no engine is
  available, or it answers 503 / refuses the connection (`EngineUnavailable`) or ends a
  generation with `abort` (its cell left rollout), the proxy waits and retries, on
  another cell where there is one, for up to `retry_timeout_s`; the harness sees no
  error. While waiting it sends SSE comments (`: keep-alive`) in streaming mode and, in
  non-streaming mode after `keepalive_s`, a 200 response whose body starts with
  newlines (JSON allows leading whitespace) so client read timeouts never fire.
- Per call: `gyre.tito.CallStore.match` (prompt ids reused or a branch), `/generate`
  with `gyre_execution` set and a fresh rid, decode (special tokens kept) and
  `gyre.chat.parse_completion`, answer, then record: the store learns the call only
  after its answer was delivered; `call.completed` (id `<run>:<execution>:call:<seq>`)
  is published in the background after delivery or a definitive failure, status `ok`,
  `aborted` (client went away: the upstream request is aborted) or `error`. An event
  whose encoding exceeds `object_threshold_bytes` carries its token arrays in the object
  store under `calls/<execution>/<seq>` (orjson `{"prompt_ids", "completion_ids",
  "logprobs"}`) and the key in `tokens_ref`.
- Chat streams: a role chunk, reasoning (`reasoning_content`) and content deltas,
  tool-call deltas (index, id, type, function name, then argument fragments), exactly
  one finish chunk (`tool_calls` | `stop` | `length`), a usage chunk when
  `stream_options.include_usage`, then `data: [DONE]`.
- `call.completed.finish_reason` is the engine's (`stop` | `length`), never inferred
  from the last token; the stop token stays in `completion_ids`.

Known limits: per-execution seq counters live in memory, so a restarted proxy starts
again at 0 (its events would collide with earlier ids); `stop` strings are not applied.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
import structlog
from aiohttp import web

from gyre.chat import call_id_prefix, parse_completion
from gyre.harness import verify_key as harness_verify_key
from gyre.tito import CallStore, Match
from handlers.engine_client import EngineClient, EngineRequestError, EngineUnavailable, make_session
from schemas import encode, ids
from schemas.call import CallCompleted, CallTokens, SamplingParams
from schemas.cell import CellSwitched, RouteUpdated
from schemas.execution import ExecutionFinished

log = structlog.get_logger()

MAX_ENGINE_ABORTS = 16
"""Engine-side aborts of one call retried before the call fails (a cell switch aborts once)."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """Proxy configuration. Durations in seconds, sizes in bytes."""

    run: str
    """Run id (bus subjects, event ids)."""
    key_secret: bytes
    """HMAC secret of the per-execution keys (gyre.harness)."""
    host: str = "127.0.0.1"
    port: int = 0
    """Listening port; 0 = a free port (written to `url_file`)."""
    model_dir: str = ""
    """HF checkpoint whose tokenizer and chat template to use; '' = gyre's built-in Qwen3 tokenizer."""
    nats_url: str = ""
    """NATS server; '' = no bus (calls are not published; only for tests and single-process use)."""
    nats_token: str | None = None
    engine_url: str = ""
    """Engine used while no rollout cell is known ('' = none: wait for `cell.switched`)."""
    static_cell: str = "static"
    """Cell name recorded for calls served by `engine_url`."""
    model_name: str = "gyre"
    """Model id listed by /v1/models."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """Default sampling when the request has none; top_k -1 = off."""
    max_completion_tokens: int = 4096
    """Cap on a call's completion tokens, and the value when the request sets none."""
    max_calls: int = 0
    """Calls one execution may start; 0 = no cap."""
    body_limit_bytes: int = 64 * 1024 * 1024
    concurrency: int = 256
    """Engine requests in flight at once; further calls queue."""
    retry_timeout_s: float = 600.0
    """How long a call waits and retries for an engine before failing with 503."""
    retry_backoff_s: float = 0.25
    retry_backoff_max_s: float = 5.0
    keepalive_s: float = 15.0
    """Seconds between keep-alives to a waiting harness."""
    object_threshold_bytes: int = 256 * 1024
    """Encoded call.completed above this moves its token arrays to the object store."""
    check_drift: bool = True
    """Re-tokenise the whole rendered request on extensions to count drift."""
    url_file: str = ""
    """If set, `{"url": ...}` is written there once the listener is bound."""
    shutdown_grace_s: float = 30.0
    """Bound on finishing in-flight calls and publishes on shutdown."""

    def __post_init__(self) -> None:
        if not self.run:
            raise ValueError("Config.run must be non-empty")
        if not self.key_secret:
            raise ValueError("Config.key_secret must be non-empty (execution keys are HMACs of it)")
        if self.host not in ("127.0.0.1", "::1", "localhost"):
            raise ValueError(f"Config.host must be a loopback address, got {self.host!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"Config.port must be in [0, 65535], got {self.port}")
        if self.temperature < 0:
            raise ValueError(f"Config.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"Config.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"Config.top_k must be -1 (off) or > 0, got {self.top_k}")
        for name in ("max_completion_tokens", "body_limit_bytes", "concurrency", "object_threshold_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Config.{name} must be > 0, got {getattr(self, name)}")
        if self.max_calls < 0:
            raise ValueError("Config.max_calls must be >= 0 (0 = no cap)")
        for name in ("retry_timeout_s", "retry_backoff_s", "retry_backoff_max_s", "keepalive_s", "shutdown_grace_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Config.{name} must be > 0 seconds, got {getattr(self, name)}")


# --------------------------------------------------------------------------- errors


class ApiError(Exception):
    """An error answered to the harness in OpenAI's shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, dumps=_dumps)


def _dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()


# --------------------------------------------------------------------------- routing


class Router:
    """Which engine serves an execution: rollout cells, scheduler routes, stickiness.

    cells: rollout cell → engine URL. routes: execution → cell from `route.updated`.
    sticky: execution → cell it was last sent to. Waiters are woken on every change.
    """

    def __init__(self, static_url: str = "", static_cell: str = "static"):
        self.static_url = static_url
        self.static_cell = static_cell
        self.cells: dict[str, str] = {}
        self.routes: dict[str, str] = {}
        self.sticky: dict[str, str] = {}
        self._changed = asyncio.Event()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def handle_cell_switched(self, event: CellSwitched) -> None:
        if event.to_role == "rollout" and event.engine_url:
            self.cells[event.cell] = event.engine_url
        else:
            self.cells.pop(event.cell, None)
        self._notify()

    def handle_route_updated(self, event: RouteUpdated) -> None:
        for route in event.routes:
            self.routes[route.execution] = route.cell
        self._notify()

    def load(self, cell: str) -> int:
        return sum(1 for c in self.sticky.values() if c == cell)

    def pick(self, execution: str, avoid: frozenset[str] = frozenset()) -> tuple[str, str] | None:
        """(cell, engine URL) for `execution`, or None when no engine is known.

        Order: the scheduler's route, the sticky cell, the least-loaded rollout cell (cells
        in `avoid` only when nothing else is left), then the static engine.
        """
        if self.cells:
            usable = [c for c in self.cells if c not in avoid] or list(self.cells)
            choice = None
            for preferred in (self.routes.get(execution), self.sticky.get(execution)):
                if preferred in usable:
                    choice = preferred
                    break
            if choice is None:
                choice = min(usable, key=lambda c: (self.load(c), c))
            self.sticky[execution] = choice
            return choice, self.cells[choice]
        if self.static_url:
            return self.static_cell, self.static_url
        return None

    async def wait_changed(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self._changed.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass


# --------------------------------------------------------------------------- responses (pure)


def _pieces(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def answer_message(content: str, reasoning: str | None, tool_calls: list[dict]) -> dict:
    """The assistant message as OpenAI returns it: content None when only tool calls."""
    msg: dict[str, Any] = {"role": "assistant", "content": content if (content or not tool_calls) else None}
    if reasoning:
        msg["reasoning_content"] = reasoning
    if tool_calls:
        msg["tool_calls"] = tool_calls
    return msg


def completion_object(*, cid: str, created: int, model: str, message: dict, finish_reason: str,
                      prompt_tokens: int, completion_tokens: int) -> dict:
    """A non-streaming `chat.completion` object."""
    return {
        "id": cid, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }


def stream_chunks(*, cid: str, created: int, model: str, message: dict, finish_reason: str,
                  prompt_tokens: int, completion_tokens: int, include_usage: bool, piece: int = 32) -> list[dict]:
    """The `chat.completion.chunk` objects of one answer, in order (without `[DONE]`)."""
    def chunk(delta: dict, finish: str | None = None) -> dict:
        out = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
               "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
        if include_usage:
            out["usage"] = None
        return out

    chunks = [chunk({"role": "assistant", "content": ""})]
    for part in _pieces(message.get("reasoning_content") or "", piece):
        chunks.append(chunk({"reasoning_content": part}))
    for part in _pieces(message.get("content") or "", piece):
        chunks.append(chunk({"content": part}))
    for i, tc in enumerate(message.get("tool_calls") or ()):
        fn = tc["function"]
        chunks.append(chunk({"tool_calls": [{"index": i, "id": tc["id"], "type": "function",
                                             "function": {"name": fn["name"], "arguments": ""}}]}))
        for part in _pieces(fn["arguments"], piece):
            chunks.append(chunk({"tool_calls": [{"index": i, "function": {"arguments": part}}]}))
    chunks.append(chunk({}, finish_reason))
    if include_usage:
        chunks.append({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                       "choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                                "total_tokens": prompt_tokens + completion_tokens}})
    return chunks


def _sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


# --------------------------------------------------------------------------- request parsing (pure)


@dataclasses.dataclass(frozen=True, slots=True)
class ChatRequest:
    messages: list
    tools: Any
    stream: bool
    include_usage: bool
    sampling: SamplingParams
    model: str


def _number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(400, f"'{name}' must be a number, got {value!r}", param=name)
    if value < lo or value > hi or (lo_open and value == lo):
        raise ApiError(400, f"'{name}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {value}", param=name)
    return float(value)


def parse_chat_request(body: Any, cfg: Config) -> ChatRequest:
    """Validate a Chat Completions body; unknown fields are ignored. Raises ApiError(400)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ApiError(400, "'tools' must be a list", param="tools")
    n = body.get("n")
    if n not in (None, 1):
        raise ApiError(400, "only n = 1 is supported", param="n")
    cap = cfg.max_completion_tokens
    max_tokens = cap
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ApiError(400, f"'{name}' must be a positive integer, got {value!r}", param=name)
        max_tokens = min(value, cap)
        break
    top_k = body.get("top_k")
    if top_k is None:
        top_k = cfg.top_k
    elif isinstance(top_k, bool) or not isinstance(top_k, int) or top_k == 0 or top_k < -1:
        raise ApiError(400, f"'top_k' must be -1 or a positive integer, got {top_k!r}", param="top_k")
    sampling = SamplingParams(
        temperature=_number(body, "temperature", cfg.temperature, 0.0, 2.0),
        top_p=_number(body, "top_p", cfg.top_p, 0.0, 1.0, lo_open=True),
        top_k=top_k,
        max_tokens=max_tokens,
    )
    options = body.get("stream_options")
    include_usage = bool(isinstance(options, dict) and options.get("include_usage"))
    model = body.get("model") if isinstance(body.get("model"), str) else cfg.model_name
    return ChatRequest(messages=messages, tools=tools, stream=bool(body.get("stream")),
                       include_usage=include_usage, sampling=sampling, model=model)


def engine_sampling(sp: SamplingParams) -> dict:
    """SGLang `sampling_params` for recorded SamplingParams."""
    return {"temperature": sp.temperature, "top_p": sp.top_p, "top_k": sp.top_k, "max_new_tokens": sp.max_tokens}


# --------------------------------------------------------------------------- state


@dataclasses.dataclass(slots=True)
class _Execution:
    """Per-execution proxy state: the TITO store (None once the execution finished) and
    the next call's seq (kept for the proxy's lifetime so event ids never repeat)."""

    store: CallStore | None
    next_seq: int = 0


@dataclasses.dataclass(slots=True)
class _Attempt:
    """The engine request in flight for a call (for aborting it upstream)."""

    client: EngineClient | None = None
    rid: str = ""
    cell: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class EngineResult:
    """One answered generation. output_ids/logprobs: (C,) sampled ids (stop token
    included) and their behaviour log-probs. finish: `stop` | `length`. versions: policy
    version spans over the completion. queue_s: seconds from the call's start to the
    successful attempt's request (waiting, retries, the concurrency limit); engine_s:
    seconds of that attempt."""

    output_ids: list[int]
    logprobs: list[float]
    finish: str
    versions: tuple[tuple[int, int, int], ...]
    cell: str
    queue_s: float
    engine_s: float


class ProxyState:
    """Everything the proxy's handlers share: config, tokenizer, engine clients, calls.

    bus: a connected `bus.Bus` or None (no events published). session: the process's one
    aiohttp ClientSession (`engine_client.make_session()`). verify_key: key → execution.
    """

    def __init__(self, cfg: Config, tokenizer: Any, session: Any, bus: Any = None,
                 verify_key: Callable[[bytes, str], str | None] = harness_verify_key):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.session = session
        self.bus = bus
        self.verify_key = verify_key
        self.router = Router(cfg.engine_url, cfg.static_cell)
        self.executions: dict[str, _Execution] = {}
        self._clients: dict[str, EngineClient] = {}
        self._semaphore = asyncio.Semaphore(cfg.concurrency)
        self._background: set[asyncio.Task] = set()

    # -- bus-fed state
    async def handle_event(self, event: Any) -> None:
        """Replay handler for `cell.switched`, `route.updated` and `execution.finished`
        (the last frees the execution's call store; its seq counter is kept)."""
        if isinstance(event, CellSwitched):
            self.router.handle_cell_switched(event)
            log.info("proxy.cell.updated", cell=event.cell, role=event.to_role, engine_url=event.engine_url)
        elif isinstance(event, RouteUpdated):
            self.router.handle_route_updated(event)
        elif isinstance(event, ExecutionFinished):
            ex = self.executions.get(event.info.execution)
            if ex is not None:
                ex.store = None
            self.router.sticky.pop(event.info.execution, None)

    def execution(self, execution: str) -> _Execution:
        ex = self.executions.get(execution)
        if ex is None:
            ex = self.executions[execution] = _Execution(store=None)
        if ex.store is None:
            ex.store = CallStore(self.tokenizer, check_drift=self.cfg.check_drift)
        return ex

    def client(self, url: str) -> EngineClient:
        c = self._clients.get(url)
        if c is None:
            c = self._clients[url] = EngineClient(url, self.session)
        return c

    def spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def drain(self, timeout_s: float) -> None:
        """Wait (≤ timeout_s) for background publishes and aborts."""
        if self._background:
            _, pending = await asyncio.wait(set(self._background), timeout=timeout_s)
            if pending:
                log.warning("proxy.drain.unfinished", tasks=len(pending))

    # -- engine
    async def generate(self, execution: str, prompt_ids: list[int], sampling: SamplingParams, call_id: str,
                       attempt: _Attempt, on_wait: Callable[[], None] | None = None) -> EngineResult:
        """Run the call on an engine, waiting and retrying transparently (module docstring).

        Raises ApiError(503) when no engine answered within retry_timeout_s, ApiError(400|502)
        when the engine refused the request.
        """
        cfg = self.cfg
        t0 = time.monotonic()
        deadline = t0 + cfg.retry_timeout_s
        backoff = cfg.retry_backoff_s
        avoid: set[str] = set()
        tries = aborts = 0
        clog = log.bind(execution=execution, call=call_id)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ApiError(503, f"no engine served the call within {cfg.retry_timeout_s:.0f}s", "server_error",
                               code="engine_unavailable")
            target = self.router.pick(execution, frozenset(avoid))
            if target is None:
                if on_wait:
                    on_wait()
                await self.router.wait_changed(min(backoff, remaining))
                backoff = min(backoff * 2, cfg.retry_backoff_max_s)
                continue
            cell, url = target
            client = self.client(url)
            rid = f"{call_id}:{tries}:{uuid.uuid4().hex[:8]}"
            tries += 1
            attempt.client, attempt.rid, attempt.cell = client, rid, cell
            try:
                async with self._semaphore:
                    t_engine = time.monotonic()
                    result = await client.generate(prompt_ids, engine_sampling(sampling), rid, execution=execution)
                attempt.client = None
            except EngineUnavailable as exc:
                attempt.client = None
                clog.info("proxy.engine.unavailable", cell=cell, error=str(exc)[:200], retry_in_s=backoff)
                avoid.add(cell)
                if on_wait:
                    on_wait()
                await asyncio.sleep(min(backoff, max(remaining, 0.0)))
                backoff = min(backoff * 2, cfg.retry_backoff_max_s)
                continue
            except EngineRequestError as exc:
                attempt.client = None
                clog.warning("proxy.engine.refused", cell=cell, status=exc.status, body=str(exc.body)[:500])
                status = 400 if 400 <= exc.status < 500 else 502
                raise ApiError(status, f"the engine refused the request: {exc.body}",
                               "invalid_request_error" if status == 400 else "server_error",
                               code="engine_error") from exc
            # On cancellation attempt.client stays set, so the caller can abort `rid` upstream.
            engine_s = time.monotonic() - t_engine
            meta = result.get("meta_info") or {}
            finish = (meta.get("finish_reason") or {}).get("type") or "stop"
            if finish == "abort":
                aborts += 1
                clog.info("proxy.engine.aborted", cell=cell, aborts=aborts)
                if aborts > MAX_ENGINE_ABORTS:
                    raise ApiError(502, "the engine aborted the generation repeatedly", "server_error",
                                   code="engine_aborted")
                avoid.add(cell)
                continue
            output_ids = [int(i) for i in result.get("output_ids") or ()]
            logprobs = [float(x[0]) for x in meta.get("output_token_logprobs") or ()]
            if len(logprobs) != len(output_ids):
                raise ApiError(502, f"the engine returned {len(output_ids)} ids but {len(logprobs)} log-probs",
                               "server_error", code="engine_error")
            spans = meta.get("gyre_versions")
            if spans:
                versions = tuple((int(s), int(e), int(v)) for s, e, v in spans)
            else:
                version = int(meta.get("weight_version") or 0)
                versions = ((0, len(output_ids), version),) if output_ids else ()
            return EngineResult(output_ids=output_ids, logprobs=logprobs, finish=finish, versions=versions,
                                cell=cell, queue_s=t_engine - t0, engine_s=engine_s)

    # -- events
    def call_event(self, *, execution: str, seq: int, match: Match, sampling: SamplingParams,
                   result: EngineResult | None, status: str, total_s: float, cell: str) -> CallCompleted:
        """The `call.completed` event of a call, tokens inline.

        status `ok`: answered. `aborted`: the harness went away (its completion, if one was
        generated but not delivered, is kept: it is still a sample of the policy). `error`:
        no engine answered, or it refused; no completion.
        """
        parent = match.parent
        tokens = CallTokens(
            prompt_ids=tuple(int(i) for i in match.new_prompt_ids.tolist()),
            completion_ids=tuple(result.output_ids) if result else (),
            logprobs=tuple(result.logprobs) if result else (),
        )
        timings = {"total_s": round(total_s, 6)}
        if result:
            timings.update(queue_s=round(result.queue_s, 6), engine_s=round(result.engine_s, 6))
            finish = result.finish
        else:
            finish = "abort" if status == "aborted" else "error"
        return CallCompleted(
            event_id=ids.call(self.cfg.run, execution, seq), call=f"{execution}:{seq}", execution=execution,
            seq=seq, parent_call=parent.call if parent else None, prefix_len=match.prefix_len if parent else 0,
            tokens=tokens, sampling=sampling, finish_reason=finish, versions=result.versions if result else (),
            cell=cell, api="chat", status=status, timings=timings, drift=match.drift,
        )

    async def publish(self, event: CallCompleted) -> None:
        """Publish `call.completed`, moving token arrays to the object store when large;
        retried with backoff for up to retry_timeout_s (the call must not be lost)."""
        if self.bus is None:
            return
        clog = log.bind(event_id=event.event_id, execution=event.execution, call=event.call)
        deadline = time.monotonic() + self.cfg.retry_timeout_s
        delay = self.cfg.retry_backoff_s
        while True:
            try:
                out = event
                if len(encode(event)) > self.cfg.object_threshold_bytes:
                    key = f"calls/{event.execution}/{event.seq}"
                    t = event.tokens
                    await self.bus.put_object(key, orjson.dumps({"prompt_ids": t.prompt_ids,
                                                                 "completion_ids": t.completion_ids,
                                                                 "logprobs": t.logprobs}))
                    out = dataclasses.replace(event, tokens=CallTokens(), tokens_ref=key)
                stored = await self.bus.publish(out)
                clog.debug("proxy.call.published", stored=stored, tokens_ref=out.tokens_ref)
                return
            except Exception as exc:  # noqa: BLE001 - keep trying within the bound; never drop silently
                if time.monotonic() + delay > deadline:
                    clog.error("proxy.call.publish_failed", error=repr(exc))
                    return
                clog.warning("proxy.call.publish_retry", error=repr(exc), retry_in_s=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.cfg.retry_backoff_max_s)


# --------------------------------------------------------------------------- handlers


def _key_of(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip() or None
    key = request.headers.get("x-api-key", "").strip()
    return key or None


def authenticate(state: ProxyState, request: web.Request) -> str:
    """The execution a request's key belongs to. Raises ApiError(401)."""
    key = _key_of(request)
    if key is None:
        raise ApiError(401, "no API key: send 'Authorization: Bearer <key>' or 'x-api-key'",
                       "authentication_error", code="missing_api_key")
    execution = state.verify_key(state.cfg.key_secret, key)
    if not execution:
        raise ApiError(401, "invalid API key", "authentication_error", code="invalid_api_key")
    return execution


async def _read_json(request: web.Request) -> Any:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise ApiError(413, f"request body too large ({exc.actual_size} > {exc.max_size} bytes)",
                       code="request_too_large") from None
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None


class _Reply:
    """The harness's response while a call waits: keep-alives now, the answer later.

    Streaming: SSE prepared at once, `: keep-alive` comments every keepalive_s.
    Non-streaming: after keepalive_s a 200 JSON response is prepared and newlines are sent.
    """

    def __init__(self, request: web.Request, stream: bool, keepalive_s: float):
        self.request = request
        self.stream = stream
        self.keepalive_s = keepalive_s
        self.resp: web.StreamResponse | None = None
        self._task: asyncio.Task | None = None

    async def _prepare(self, content_type: str) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers={"Content-Type": content_type, "Cache-Control": "no-cache",
                                                       "X-Accel-Buffering": "no"})
        await resp.prepare(self.request)
        self.resp = resp
        return resp

    async def start(self) -> None:
        if self.stream:
            await self._prepare("text/event-stream; charset=utf-8")
        self._task = asyncio.ensure_future(self._keepalive())

    async def _keepalive(self) -> None:
        try:
            while True:
                await asyncio.sleep(self.keepalive_s)
                if self.resp is None:
                    await self._prepare("application/json")
                await self.resp.write(b": keep-alive\n\n" if self.stream else b"\n")
        except (ConnectionResetError, asyncio.CancelledError):
            pass

    async def stop_keepalive(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def send(self, body: dict | list[dict]) -> web.StreamResponse:
        """Deliver the answer (a completion object, or the stream's chunks) and end it."""
        await self.stop_keepalive()
        if self.stream:
            resp = self.resp
            for chunk in body:
                await resp.write(_sse(chunk))
            await resp.write(b"data: [DONE]\n\n")
        else:
            data = orjson.dumps(body)
            if self.resp is None:
                resp = web.Response(body=data, content_type="application/json")
                await resp.prepare(self.request)
                await resp.write_eof()
                return resp
            resp = self.resp
            await resp.write(data)
        await resp.write_eof()
        return resp

    async def fail(self, err: ApiError) -> web.StreamResponse:
        await self.stop_keepalive()
        if self.resp is None:
            return err.response()
        if self.stream:
            await self.resp.write(_sse(err.body()))
        else:
            await self.resp.write(orjson.dumps(err.body()))
        await self.resp.write_eof()
        return self.resp


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state: ProxyState = request.app[STATE]
    cfg = state.cfg
    t0 = time.monotonic()
    try:
        execution = authenticate(state, request)
        req = parse_chat_request(await _read_json(request), cfg)
        ex = state.execution(execution)
        if cfg.max_calls and ex.next_seq >= cfg.max_calls:
            raise ApiError(400, f"this execution has used its {cfg.max_calls} model calls; stop here",
                           code="max_calls_exceeded")
        store = ex.store
        try:
            match = store.match(req.messages, req.tools)
        except ValueError as exc:
            raise ApiError(400, f"cannot render the conversation: {exc}", param="messages") from None
        except Exception as exc:  # noqa: BLE001 - e.g. a template error on odd input: the request's fault
            log.warning("proxy.render.failed", execution=execution, error=repr(exc), exc_info=True)
            raise ApiError(400, f"cannot render the conversation: {exc!r}", param="messages") from None
    except ApiError as err:
        log.info("proxy.request.refused", status=err.status, code=err.code, error=err.message[:200])
        return err.response()

    seq = ex.next_seq
    ex.next_seq += 1
    call_id = f"{execution}:{seq}"
    clog = log.bind(execution=execution, call=call_id)
    reply = _Reply(request, req.stream, cfg.keepalive_s)
    attempt = _Attempt()
    result: EngineResult | None = None
    delivered = False
    try:
        await reply.start()
        prompt = match.prompt_ids.tolist()
        try:
            result = await state.generate(execution, prompt, req.sampling, call_id, attempt)
        except ApiError as err:
            clog.warning("proxy.call.failed", status=err.status, error=err.message[:300])
            resp = await reply.fail(err)
            state.spawn(state.publish(state.call_event(
                execution=execution, seq=seq, match=match, sampling=req.sampling, result=None, status="error",
                total_s=time.monotonic() - t0, cell=attempt.cell)))
            return resp
        text = state.tokenizer.decode(result.output_ids, skip_special_tokens=False)
        parsed = parse_completion(text, id_prefix=call_id_prefix(f"{cfg.run}:{call_id}"))
        tool_calls = [{"id": tc.id, "type": "function", "function": {"name": tc.name, "arguments": tc.arguments}}
                      for tc in parsed.tool_calls]
        message = answer_message(parsed.content, parsed.reasoning, tool_calls)
        finish = "tool_calls" if tool_calls and result.finish == "stop" else result.finish
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        common = dict(cid=cid, created=created, model=req.model, message=message, finish_reason=finish,
                      prompt_tokens=len(prompt), completion_tokens=len(result.output_ids))
        body = stream_chunks(**common, include_usage=req.include_usage) if req.stream else completion_object(**common)
        resp = await reply.send(body)
        delivered = True
        # No await between delivery and recording: the harness's next call sees this one.
        store.record(match, call=call_id, seq=seq, answer=message, completion_ids=result.output_ids)
        state.spawn(state.publish(state.call_event(
            execution=execution, seq=seq, match=match, sampling=req.sampling, result=result, status="ok",
            total_s=time.monotonic() - t0, cell=result.cell)))
        clog.info("proxy.call.recorded", seq=seq, parent=match.parent.call if match.parent else None,
                  prefix_len=match.prefix_len, extended=match.extended, prompt_tokens=len(prompt),
                  new_prompt_tokens=len(prompt) - match.prefix_len, completion_tokens=len(result.output_ids),
                  finish=result.finish, drift=match.drift, cell=result.cell, stream=req.stream,
                  total_s=round(time.monotonic() - t0, 4))
        return resp
    except (asyncio.CancelledError, ConnectionResetError):
        if not delivered:
            clog.info("proxy.call.client_gone", seq=seq)
            state.spawn(_abandon(state, attempt, execution, seq, match, req.sampling, result, t0))
        raise
    finally:
        await reply.stop_keepalive()


async def _abandon(state: ProxyState, attempt: _Attempt, execution: str, seq: int, match: Match,
                   sampling: SamplingParams, result: EngineResult | None, t0: float) -> None:
    """The harness went away: abort the engine request, publish the call as `aborted`."""
    if attempt.client is not None and attempt.rid:
        try:
            await attempt.client.abort(attempt.rid)
        except Exception as exc:  # noqa: BLE001 - the engine may be gone too; the call is still recorded
            log.info("proxy.engine.abort_failed", rid=attempt.rid, error=repr(exc))
    await state.publish(state.call_event(execution=execution, seq=seq, match=match, sampling=sampling,
                                         result=result, status="aborted", total_s=time.monotonic() - t0,
                                         cell=attempt.cell))


async def models(request: web.Request) -> web.Response:
    state: ProxyState = request.app[STATE]
    try:
        authenticate(state, request)
    except ApiError as err:
        return err.response()
    return web.json_response({"object": "list", "data": [
        {"id": state.cfg.model_name, "object": "model", "created": 0, "owned_by": "gyre"}]})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def root(request: web.Request) -> web.Response:
    return web.Response(text="gyre proxy\n")


async def not_found(request: web.Request) -> web.Response:
    return ApiError(404, f"unknown endpoint {request.method} {request.path}", code="unknown_url").response()


STATE = web.AppKey("state", ProxyState)


def make_app(state: ProxyState) -> web.Application:
    """The proxy's aiohttp application (serve it with `handler_cancellation=True`, as
    `start` does, so a harness that goes away aborts its call upstream)."""
    app = web.Application(client_max_size=state.cfg.body_limit_bytes)
    app[STATE] = state
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/", root)
    app.router.add_route("*", "/v1/{tail:.*}", not_found)
    return app


async def start(state: ProxyState) -> tuple[web.AppRunner, str]:
    """Serve `make_app(state)` on cfg.host:cfg.port; returns the runner and the base URL."""
    runner = web.AppRunner(make_app(state), handler_cancellation=True, access_log=None,
                           shutdown_timeout=state.cfg.shutdown_grace_s)
    await runner.setup()
    site = web.TCPSite(runner, state.cfg.host, state.cfg.port)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://{state.cfg.host}:{port}"


def load_tokenizer(model_dir: str) -> Any:
    if model_dir:
        from gyre.model import load_tokenizer as from_checkpoint

        return from_checkpoint(model_dir)
    from gyre.tokenizer import build_tokenizer

    return build_tokenizer()


async def run(cfg: Config, stop: asyncio.Event,
              on_started: Callable[[ProxyState, str], None] | None = None) -> None:
    """Serve until `stop`; then finish in-flight calls and publishes within shutdown_grace_s.

    on_started(state, url) is called once the listener is bound (embedding and tests)."""
    from bus import Bus

    tokenizer = load_tokenizer(cfg.model_dir)
    bus = None
    if cfg.nats_url:
        bus = await Bus.connect(cfg.nats_url, token=cfg.nats_token, run=cfg.run, name="proxy")
        await bus.ensure_streams()
    session = make_session()
    state = ProxyState(cfg, tokenizer, session, bus)
    runner, url = await start(state)
    if cfg.url_file:
        path = Path(cfg.url_file)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(orjson.dumps({"url": url, "v1": url + "/v1"}))
        tmp.replace(path)
    log.info("proxy.started", url=url, engine_url=cfg.engine_url or None, bus=bool(bus))
    if on_started is not None:
        on_started(state, url)
    replay = None
    if bus is not None:
        replay = asyncio.create_task(bus.replay(["cell.switched", "route.updated", "execution.finished"],
                                                state.handle_event, stop=stop))
    try:
        await stop.wait()
    finally:
        await runner.shutdown()
        await runner.cleanup()
        await state.drain(cfg.shutdown_grace_s)
        if replay is not None:
            try:
                await asyncio.wait_for(replay, cfg.shutdown_grace_s)
            except (asyncio.TimeoutError, Exception) as exc:  # noqa: BLE001 - shutting down anyway
                log.info("proxy.replay.stopped", error=repr(exc))
        await session.close()
        if bus is not None:
            await bus.close()
        log.info("proxy.stopped")


def config_from_context(ctx: Any, args: Any) -> Config:
    r = ctx.recipe
    return Config(run=ctx.run, key_secret=ctx.key_secret, port=args.port, model_dir=str(ctx.model_dir),
                  nats_url=ctx.nats_url, nats_token=ctx.nats_token, engine_url=args.engine_url or "",
                  temperature=r.sampling.temperature, top_p=r.sampling.top_p, top_k=r.sampling.top_k,
                  max_completion_tokens=r.sampling.max_tokens, max_calls=r.harness.max_calls,
                  url_file=str(ctx.run_dir / "proxy.json"))


def main(argv: list[str] | None = None) -> int:
    from handlers.daemon import daemon_main

    def extra(p: Any) -> None:
        p.add_argument("--port", type=int, default=0, help="listening port on 127.0.0.1 (0 = free port)")
        p.add_argument("--engine-url", default="", help="engine used while no rollout cell is known")

    return daemon_main("proxy", "OpenAI-compatible model endpoint with token-in/token-out capture",
                       config_from_context, run, argv, extra_args=extra)


if __name__ == "__main__":
    raise SystemExit(main())
