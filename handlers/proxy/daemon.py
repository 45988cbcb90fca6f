"""Proxy daemon: the harness's model endpoint, with token-in/token-out capture.

Contract (DESIGN.md "Processes", "Token-in, token-out"):
- Routes: `POST /v1/chat/completions`, `POST /v1/responses` and `POST
  /v1/responses/input_tokens` (OpenAI shapes, handlers/proxy/openai.py; `/v1/responses/{id}`
  is a 404: no response is stored), `POST /v1/messages` and `POST /v1/messages/count_tokens`
  (Anthropic shapes, handlers/proxy/anthropic.py; a `?beta=true` query is ignored),
  `GET /v1/models` and `/v1/models/{id}` (any id), all of them also without `/v1`; `GET
  /health`, `GET|HEAD /`. Any model name is accepted; unknown fields and
  `anthropic-beta` flags are ignored. Sampling:
  `temperature`/`top_p`/`top_k` honoured and recorded (Config defaults when absent), the
  completion cap (`max_tokens`, `max_completion_tokens`, `max_output_tokens`) clamped to
  `Config.max_completion_tokens`.
- Auth: `Authorization: Bearer <key>` or `x-api-key: <key>`, a per-execution key checked
  by `gyre.env.harness.verify_key`; the key alone names the execution a call is recorded in.
  Errors in the API's own shape: 401 (missing/invalid key), 403 code
  `execution_finished` (the key's execution has finished), 400 (malformed JSON or
  request), 413 (body over `body_limit_bytes`, also once decoded), 415 (a
  `Content-Encoding` this process cannot decode: gzip and deflate always, zstd when its
  module is installed, never br), 429 with `Retry-After` (more than
  `max_active_calls` calls in flight, or `max_active_calls_per_execution` for one
  execution), 400 code `max_calls_exceeded` once an execution has started `max_calls`
  model calls (non-retryable, so the harness stops), 502/503 only when the engine refused
  the request or none was reachable within `retry_timeout_s` (or, once the proxy is
  stopping, no rollout cell is left: 503 code `proxy_stopping`).
- Roles (gyre.serving.roles): each call is classified with the execution's harness profile
  (learnt from `execution.started`'s harness, else `Config.harness`, else detected from
  the headers); role and session metadata go on `call.completed`. `auxiliary` calls
  (count_tokens, titles, small side models) are answered and published but never enter
  the call store: they are rendered alone (parent None) and never shape the tree; a token
  count is attached as a model call with its body would be, so it equals that call's
  input tokens, and published as a root all the same.
- Routing: sticky per execution. Rollout cells are learnt from `cell.switched`
  (`to_role` rollout with an `engine_url`; any other role removes the cell) and
  assignments from `route.updated`, both replayed from the bus. An execution without an
  assignment goes to the rollout cell with the fewest executions and sticks. With no
  cell known, `Config.engine_url` (cell `Config.static_cell`) serves. When the engine
  answers 503, 429 or 408 / refuses the connection / drops it (`EngineUnavailable`),
  takes longer than `proxy_routing.generate_bound_s` (10 min + max_tokens at 5 tokens/s:
  it counts as hung), answers another 5xx (a few times: `proxy_routing.MAX_ENGINE_ERRORS`),
  ends a generation with `abort`, or its cell leaves rollout while the request is
  in flight (the request is then aborted upstream, `/abort_request`), the proxy retries
  on another rollout cell, or waits for one, for up to `retry_timeout_s`; the harness
  sees no error (`handlers.proxy.routing.Dispatcher`). At most `concurrency` requests
  run on each engine; a reply that is not a sample of the policy (`engine_reply`) is a
  502.
  While waiting it sends keep-alives (SSE comments; Anthropic `ping` events; in
  non-streaming mode after `keepalive_s`, a 200 response whose body starts with newlines;
  should the call then fail, the body is cut short, which SDKs retry as a broken
  connection, since no status can be sent any more).
  A stream opens (headers, then the opening events of Anthropic and Responses:
  `message_start` with the prompt length; `response.created`, `response.in_progress`)
  with its answer or after min(`STREAM_OPEN_S` (0.25 s), keepalive_s), whichever comes
  first: an answer ready by then goes out in one write, and a failure by then is an HTTP
  error.
- Per call: `gyre.serving.tito.CallStore.match` (prompt ids reused or a branch; rendering and
  encoding of more than `gyre.serving.tito.HEAVY_CHARS` characters — a branch or count_tokens of a
  long conversation, an extension by a huge message, with another template than gyre's
  any long extension — in the one branch thread, off the event loop), `/generate` with
  `gyre_execution` set and a fresh rid, decode (special tokens kept) and
  `gyre.serving.chat.parse_completion`, answer in the API's shape, then record: the store learns
  the call only after its answer was delivered; `call.completed` (id
  `<run>:<execution>:call:<seq>`) is published in the background after delivery or a
  definitive failure, status `ok`, `aborted` (the client went away: the upstream request
  is aborted; or it took none of its answer for `deliver_timeout_s`, 120 s, and its
  connection was cut) or `error`. A token count (count_tokens, Responses' input_tokens) is
  published as an `auxiliary` call with the counted prompt, no completion, finish `stop`. An event whose encoding exceeds
  `object_threshold_bytes` carries its token arrays in the object store under
  `calls/<execution>/<seq>` (orjson `{"prompt_ids", "completion_ids", "logprobs"}`) and
  the key in `tokens_ref`. A `call.completed` without its PubAck after `retry_timeout_s`,
  or at shutdown, is spilled to `Config.spill_file` and published once the bus is back
  (on reconnecting or the next acknowledged publish, else every `SPILL_RETRY_S`) or by the next proxy
  before it serves. A proxy serves once its
  replay of the run's events (`REPLAYED`) has caught up.
- `call.completed.finish_reason` is the engine's (`stop` | `length`), never inferred
  from the last token; the stop token stays in `completion_ids`. Stop strings (OpenAI
  `stop`, Anthropic `stop_sequences`) go to the engine and into `sampling.stop`; when the
  engine reports one as what ended the completion, its ids stay in `completion_ids` too,
  while the answer ends before it (Anthropic: `stop_reason` `stop_sequence` unless there
  are tool calls); the next call extends that completion like one cut by `length`
  (`<|im_end|>` appended, never sampled).
- Cost per extended call: Python work in proportion to the new messages only (the
  store renders and tokenises the suffix alone, counts drift on one turn, and reuses the
  normalisation and, for Messages, the conversion of messages seen in the execution's
  earlier requests, and the JSON text of the prompt ids their calls sent the engine). The
  body itself is parsed only after the bytes it shares with one of the execution's latest
  bodies (`handlers.proxy.body.BodyMemo`): the resent messages are that body's objects, so
  comparing them downstream is identity checks. What still grows with the history are
  C-speed passes (comparing the body's bytes with the earlier body's, copying the prompt's
  ids and their JSON text). The answer's turn is
  rendered and tokenised for the next call's drift after delivery.
  Publishes run in the background, at most `max_publishes_in_flight` awaiting a PubAck.

Restarts: before serving, the proxy reads the ids of the run's stored `call.completed`
events (headers only) and continues each execution's seq after its highest, so event
ids never repeat; a restarted proxy's call stores are empty, so each execution's next
call is a new root (its full prompt in the event). One proxy serves a run: a proxy does
not start while the proxy named in its url file answers `/health` for the same run, nor
while the one before it still holds the run lock beside that file (`_run_lock`: until it
has drained and spilled its late publishes, which the new one then publishes first).
After a restart `max_calls` counts each execution's stored calls as started, but for its
count_tokens calls (their `call.completed` carries the header `Gyre-Request-Kind:
count_tokens`; an event stored before that header existed counts as a model call).

Known limits: Anthropic `thinking: disabled` does
not switch the template's thinking off; `tool_choice` and `parallel_tool_calls` are not
acted on (the policy decides); a final assistant message (a prefill) is rendered as a
finished turn; a stop string completed by the last token allowed
is reported by SGLang as `length` (it checks the length first), so the answer then keeps it.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import gc
import os
import sys
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping, Set
from pathlib import Path
from typing import Any, NamedTuple, NoReturn

import orjson
import structlog
from aiohttp import web

from bus.client import PayloadTooLarge
from bus.subjects import CALLS_DUPLICATE_WINDOW_S
from gyre.serving.chat import parse_completion
from gyre.env.harness import verify_key as harness_verify_key
from gyre.serving.roles import PROFILES, CallFacts, Classification, classify, clean_meta, profile_for_harness
from gyre.serving.tito import CallStore, Match, Pending, Prepared
from gyre.serving.tokenizer import THINK_END, fast_decoder, fast_encoder, token_bytes
from handlers.engines.client import ids_json, make_session
from handlers.proxy.anthropic import MessagesApi, parse_messages_request
from handlers.proxy.body import BodyMemo
from handlers.proxy.api import (
    Answer, Api, ApiError, MessageMemo, ModelRequest, StreamStart, completion_room, context_exceeded,
    internal_message, unique_hex,
)
from handlers.proxy.http import Reply, error_response, key_of, read_json, serving_proxy, url_in
from handlers.proxy.openai import ChatApi, ResponsesApi, parse_chat_request, parse_responses_request
from handlers.proxy.routing import Attempt, Dispatcher, EngineResult, Router
import schemas
from schemas import encode, ids
from schemas.call import CallCompleted, CallTokens, SamplingParams
from schemas.cell import CellSwitched, RouteUpdated
from schemas.execution import ExecutionFinished, ExecutionStarted

__all__ = ["ApiError", "Config", "ProxyState", "Router", "make_app", "run", "start", "main"]

log = structlog.get_logger()

CHAT, RESPONSES, MESSAGES = ChatApi(), ResponsesApi(), MessagesApi()

GC_THRESHOLDS = (50_000, 20, 100)
"""Cyclic-GC thresholds while serving (CPython's default is (700, 10, 10)): every request
allocates hundreds of containers that reference counting frees, and collecting every 700
allocations promoted in-flight requests into the old generations, so full collections
(tens of ms with a few hundred executions' stores) ran every few seconds; with (10,000,
10, 10) and the startup objects frozen (`gc.freeze`) the proxy's GC time fell 3-5x in the
proxy bench. At (10,000, 10, 10) the young collections still examined the ~64 calls in
flight over and over (≈ 3 % of a saturated proxy's CPU, pauses of 3-9 ms); at these
values, interleaved with them (`chat`, 3 runs each), saturated CPU per call fell 1.064 →
1.025 ms and added p99 9.4 → 6.0 ms. Cyclic garbage (rare: exceptions on failure paths)
waits longer for its collection (a full collection after 100 middle ones)."""

WIRE_CACHE = 4
"""Recorded calls per execution whose ids are kept as JSON text (`_Execution.wire`): a call
leaves when a recorded call extends it, so these are the tips of up to 4 lines (main,
sub-agents, summaries) and a line's history is kept once, ≈ 4.5-6 bytes a token (a
1M-token rollout: ≈ 5 MB beside the store's ids)."""

KEY_CACHE = 65_536
"""Valid API keys whose execution `ProxyState.execution_of` keeps (least recently used
dropped); rejected keys are never kept, so unauthenticated requests cannot fill it."""

CLOSE_RESERVE_S = 1.5
"""The end of `Config.shutdown_grace_s` kept, in seconds (at most a tenth of it), for
closing the replay, the HTTP session and the bus once the drain is over (a frozen
nats-server holds each close to its bound), and for the process's exit after `run`
returns (`main` skips the interpreter's teardown: milliseconds)."""
SPILL_RETRY_S = 2.0
"""How often a serving proxy tries to publish what it spilled when no publish has been
acknowledged since (`_resend_spilled`): soon, so that a call spilled at the end of a burst
still lands before its execution is scored (each try itself waits for the bus, retrying
with backoff within `retry_timeout_s`)."""
SPILL_RETRY_MAX_S = 60.0
"""The longest wait between tries of `_resend_spilled` while they keep failing (each reads
the run's stored call ids, ≈ 25 s for a million)."""
PUBLISH_RETRY_MAX_S = CALLS_DUPLICATE_WINDOW_S - 180.0
"""Longest a `call.completed` publish is retried before it is spilled (`_publish`): within
the CALLS stream's duplicate window, less a bound on one `Bus.publish`'s own attempts, so
that a retry after an attempt whose PubAck alone was lost is still dropped as a duplicate."""
REPLAYED = ("cell.switched", "route.updated", "execution.started", "execution.finished")
"""Events the proxy's state is rebuilt from (`ProxyState.handle_event`)."""


TOKEN_JSON_BYTES = 32
"""An upper bound on the JSON bytes of one token of `call.completed`: an id of ≤ 6 digits
and its comma, and for a sampled one its log-prob (a float as orjson writes it, ≤ 24
characters) and comma. Below `object_threshold_bytes / TOKEN_JSON_BYTES` tokens an
event's arrays are not measured before publishing (`ProxyState._publish` still moves an
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
    (`ProxyState.resume_seqs`, reading headers only); none for every other call."""
    if event.role == "auxiliary" and event.meta.get("request_kind") == "count_tokens":
        return {REQUEST_KIND_HEADER: "count_tokens"}
    return {}


class Outgoing(NamedTuple):
    """A `call.completed` to publish, and the JSON of its token arrays when they go to the
    object store under `event.tokens_ref` (None: inline, or moved there at publish time if
    the event's encoding exceeds `object_threshold_bytes`)."""

    event: CallCompleted
    tokens_json: bytes | None = None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """Proxy configuration. Durations in seconds, sizes in bytes."""

    run: str
    """Run id (bus subjects, event ids)."""
    key_secret: bytes
    """HMAC secret of the per-execution keys (gyre.env.harness)."""
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
    """Model id listed by /v1/models (and echoed when a request names none)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """Default sampling when the request has none; top_k -1 = off."""
    max_completion_tokens: int = 4096
    """Cap on a call's completion tokens, and the value when the request sets none."""
    max_calls: int = 0
    """Model calls one execution may start (count_tokens not counted); 0 = no cap."""
    context_tokens: int = 0
    """The policy's context window in tokens (prompt + completion). A prompt that leaves no
    room in it (`proxy_api.completion_room`, SGLang's count) is refused before it reaches
    an engine, with the API's own prompt-too-long error (`proxy_api.context_exceeded`:
    harnesses compact on it); otherwise the completion cap is at most the room left (SGLang
    refuses prompt + max_new_tokens beyond its context), and the call records that cap.
    0 = not known yet: the first engine refusal that names the context teaches it
    (`ProxyState.context_tokens`), and the refused call is retried with the cap when its
    prompt fits."""
    body_limit_bytes: int = 64 * 1024 * 1024
    """Largest request body, as sent and once decoded."""
    concurrency: int = 256
    """Engine requests in flight at once per engine; further calls to it queue."""
    max_active_calls: int = 0
    """Model calls admitted at once (queued or generating); beyond → 429. 0 = no cap."""
    max_active_calls_per_execution: int = 0
    """The same bound per execution; 0 = no cap."""
    retry_after_s: int = 1
    """`Retry-After` seconds on a 429."""
    harness: str = ""
    """Roles profile (gyre.serving.roles.PROFILES) for executions whose harness is not known from
    `execution.started`; '' = detect it from each call's headers."""
    retry_timeout_s: float = 600.0
    """How long a call waits and retries for an engine before failing with 503, and a
    `call.completed` is retried before it is spilled (at most `PUBLISH_RETRY_MAX_S`)."""
    retry_backoff_s: float = 0.25
    retry_backoff_max_s: float = 5.0
    keepalive_s: float = 15.0
    """Seconds between keep-alives to a waiting harness."""
    deliver_timeout_s: float = 120.0
    """How long a harness may go without taking any of its answer once it is sent (checked
    every quarter of it, so the cut comes 1–1.25 × this after its last read). One that
    stops reading (a stalled client with an answer larger than the sockets hold) has its
    connection cut, and the call is recorded `aborted` (never trained) instead of holding
    its handler, and its execution's slot, until the proxy stops; one that reads slowly but
    steadily is never cut."""
    object_threshold_bytes: int = 256 * 1024
    """Encoded call.completed above this moves its token arrays to the object store."""
    max_publishes_in_flight: int = 512
    """`call.completed` publishes awaiting their PubAck at once; later ones wait their turn
    in the background (never dropped; each is still acknowledged)."""
    check_drift: bool = True
    """Count drift on extensions (`gyre.serving.tito.CallStore`: one turn re-tokenised with gyre's
    template, the whole rendered request with another); False reports drift 0."""
    url_file: str = ""
    """If set, `{"url": ...}` is written there once the listener is bound."""
    spill_file: str = ""
    """Where a `call.completed` goes when it cannot be published: no PubAck within
    `retry_timeout_s` (the bus is down), or still unacknowledged once `shutdown_grace_s` is
    over (JSON lines: the event, its token arrays' JSON). The next proxy started with the
    same file publishes what it holds before it serves, then removes it (`republish`).
    '' = such a call is lost (logged as an error). A run's proxy uses
    `<run_dir>/proxy-unpublished.jsonl`."""
    shutdown_grace_s: float = 20.0
    """The whole stop, in seconds: calls in flight get until `stop_reserve_s()` before its
    end, then are cancelled (each published as `aborted`, its engine request aborted);
    publishes get the rest but `close_reserve_s()`; what is then still unacknowledged is
    spilled. Keep it below what a supervisor waits before SIGKILL (`gyre run`: 30 s;
    Kubernetes: 30 s by default): a call killed unspilled is lost."""
    tune_gc: bool = True
    """While serving: freeze the objects alive at startup (tokenizer, modules) out of the
    cyclic GC and collect less often (`GC_THRESHOLDS`); restored when `run` returns."""

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
        for name in ("max_completion_tokens", "body_limit_bytes", "concurrency", "object_threshold_bytes",
                     "retry_after_s", "max_publishes_in_flight"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Config.{name} must be > 0, got {getattr(self, name)}")
        for name in ("max_calls", "context_tokens", "max_active_calls", "max_active_calls_per_execution"):
            if getattr(self, name) < 0:
                raise ValueError(f"Config.{name} must be >= 0 (0 = no cap), got {getattr(self, name)}")
        if self.harness and self.harness not in PROFILES:
            raise ValueError(f"Config.harness must be '' or one of {PROFILES}, got {self.harness!r}")
        for name in ("retry_timeout_s", "retry_backoff_s", "retry_backoff_max_s", "keepalive_s", "deliver_timeout_s",
                     "shutdown_grace_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Config.{name} must be > 0 seconds, got {getattr(self, name)}")

    def close_reserve_s(self) -> float:
        """The end of `shutdown_grace_s` kept for closing once publishes are over (`CLOSE_RESERVE_S`)."""
        return min(CLOSE_RESERVE_S, self.shutdown_grace_s / 10)

    def stop_reserve_s(self) -> float:
        """The end of `shutdown_grace_s` kept for publishes and closing once calls are
        cancelled: min(5 s, a quarter) for publishes, then `close_reserve_s`."""
        return min(5.0, self.shutdown_grace_s / 4) + self.close_reserve_s()

    def sampling_defaults(self) -> SamplingParams:
        """Sampling when a request sets none; max_tokens is the completion cap."""
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              max_tokens=self.max_completion_tokens)


# --------------------------------------------------------------------------- state


@dataclasses.dataclass(slots=True)
class _Execution:
    """Per-execution proxy state: the TITO store, the request-conversion memo and the prompt
    JSON of the latest calls (`wire`; None, None and empty once the execution finished), the
    next call's seq (kept for the proxy's lifetime so event ids never repeat), model calls
    started (for `max_calls`), calls in flight, the roles profile (None = detect), and whether
    its `execution.finished` has been seen (its key then takes no more calls)."""

    store: CallStore | None
    memo: MessageMemo | None = None
    bodies: BodyMemo | None = None
    """The latest request bodies, so a resent history is not parsed again (`handlers.proxy.body`)."""
    finished: bool = False
    next_seq: int = 0
    model_calls: int = 0
    active: int = 0
    harness: str | None = None
    wire: dict[str, bytes] = dataclasses.field(default_factory=dict)
    """call → the JSON text of its full ids (prompt + completion), for its latest
    WIRE_CACHE recorded calls (`prompt_json`)."""

    def prompt_json(self, match: Match) -> bytes:
        """The JSON array of `match.prompt_ids` as sent to the engine. An extension of a call
        in `wire` is that call's text + its new ids, so a long history is not serialised
        again on every call (13k ids: ≈ 25-75 µs; a 1M-token rollout: milliseconds)."""
        parent = match.parent
        head = self.wire.get(parent.call) if parent is not None and match.extended else None
        if head is None or match.prefix_len != parent.full_len:
            return ids_json(match.prompt_ids)
        return _joined(head, ids_json(match.new_prompt_ids))

    def remember(self, match: Match, call: str, prompt_json: bytes, completion_ids: list[int]) -> None:
        """Keep the JSON of a recorded call's full ids for its extensions, in place of its
        parent's when it extends it (the line's tip moves; a retry of the parent's
        extension then serialises its prompt in full)."""
        if match.extended and match.parent is not None:
            self.wire.pop(match.parent.call, None)
        self.wire[call] = _joined(prompt_json, ids_json(completion_ids))
        while len(self.wire) > WIRE_CACHE:
            del self.wire[next(iter(self.wire))]


def _joined(head: bytes, tail: bytes) -> bytes:
    """The JSON arrays `head` and `tail` as one array."""
    if tail == b"[]":
        return head
    if head == b"[]":
        return tail
    return b"".join((memoryview(head)[:-1], b",", memoryview(tail)[1:]))  # one copy


class _InvalidKey(Exception):
    pass


def _valid_key(verify_key: Callable[[bytes, str], str | None], secret: bytes, key: str) -> str:
    execution = verify_key(secret, key)
    if not execution:
        raise _InvalidKey
    return execution


class ProxyState:
    """Everything the proxy's handlers share: config, tokenizer, engine clients, calls.

    bus: a connected `bus.Bus` or None (no events published). session: the process's one
    aiohttp ClientSession (`engine_client.make_session()`). verify_key: (secret, key) →
    execution or None; `execution_of(key)` caches its valid answers (an HMAC per call
    otherwise; `KEY_CACHE`).
    """

    def __init__(self, cfg: Config, tokenizer: Any, session: Any, bus: Any = None,
                 verify_key: Callable[[bytes, str], str | None] = harness_verify_key):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.decode = fast_decoder(tokenizer)
        self.token_bytes = token_bytes(tokenizer)
        self.session = session
        self.bus = bus
        self._valid_key = functools.lru_cache(maxsize=KEY_CACHE)(functools.partial(_valid_key, verify_key, cfg.key_secret))
        self.router = Router(cfg.engine_url, cfg.static_cell)
        self.executions: dict[str, _Execution] = {}
        self.active = 0
        self.defaults = cfg.sampling_defaults()
        self.context_tokens = cfg.context_tokens
        """The context window in force (`Config.context_tokens`, or learnt from an engine)."""
        self.engines = Dispatcher(self.router, session, concurrency=cfg.concurrency,
                                  retry_timeout_s=cfg.retry_timeout_s, retry_backoff_s=cfg.retry_backoff_s,
                                  retry_backoff_max_s=cfg.retry_backoff_max_s, spawn=self.spawn,
                                  vocab_size=vocab_size(cfg.model_dir))
        self._publishing = asyncio.Semaphore(cfg.max_publishes_in_flight)
        self._background: set[asyncio.Task] = set()
        self._unsent: dict[str, Outgoing] = {}
        """event id → each `call.completed` handed to `publish` and not yet acknowledged."""
        self._republished: set[str] = set()
        """Event ids of spilled calls this proxy has published again (`_republish_one`)."""
        self._spilled = False
        """Calls were spilled and not yet sent again (`_resend_spilled`)."""
        self.bus_back = asyncio.Event()
        """Set by an acknowledged publish while `_spilled`: time to send the spilled calls."""
        self._branch_thread: concurrent.futures.ThreadPoolExecutor | None = None
        self.calls: set[asyncio.Task] = set()
        """The handler tasks of the model calls being served (`finish_calls`)."""
        self.calls_cancelled = False
        """`finish_calls` has cancelled the calls still served: a cancelled handler is the
        stop's doing, not its client's."""

    def branch_thread(self) -> concurrent.futures.ThreadPoolExecutor:
        """The one worker thread that renders and encodes heavy requests (`_match`), made on
        first use. One: they queue behind each other instead of contending for the GIL with
        the event loop (six at once in the default pool lagged the loop up to 171 ms)."""
        if self._branch_thread is None:
            self._branch_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gyre-branch")
        return self._branch_thread

    def close(self) -> None:
        """Stop the branch thread (work it has not started is dropped) and drop the engines'
        idle connections; after `drain`."""
        self.engines.close()
        if self._branch_thread is not None:
            self._branch_thread.shutdown(wait=False, cancel_futures=True)

    def execution_of(self, key: str) -> str | None:
        """The execution `key` was issued for, or None for a forged or malformed key."""
        try:
            return self._valid_key(key)
        except _InvalidKey:  # lru_cache keeps no exception: rejected keys take no room
            return None

    # -- bus-fed state
    async def handle_event(self, event: Any) -> None:
        """Replay handler for `cell.switched`, `route.updated`, `execution.started` (the
        execution's harness profile) and `execution.finished` (frees the execution's call
        store, memo and prompt JSON; its seq counter is kept)."""
        if isinstance(event, CellSwitched):
            self.router.handle_cell_switched(event)
            log.info("proxy.cell.updated", cell=event.cell, role=event.to_role, engine_url=event.engine_url)
        elif isinstance(event, RouteUpdated):
            self.router.handle_route_updated(event)
        elif isinstance(event, ExecutionStarted):
            ex = self.executions.setdefault(event.info.execution, _Execution(store=None))
            ex.harness = profile_for_harness(event.info.harness)
        elif isinstance(event, ExecutionFinished):
            ex = self.executions.setdefault(event.info.execution, _Execution(store=None))
            ex.store = ex.memo = ex.bodies = None
            ex.wire = {}
            ex.finished = True
            self.router.forget(event.info.execution)

    def resume_seqs(self, stored: Mapping[str, Mapping[str, str]]) -> int:
        """Continue each execution's seq after the highest of its `call.completed` event ids
        (`<run>:<execution>:call:<seq>`) stored by an earlier proxy of this run, so a
        restarted proxy's events never reuse an id (JetStream would drop them as duplicates
        within its window; after it, two calls would share a call id). stored: event id →
        its headers (`Bus.stored_ids`). Returns the number of executions resumed. Ids of
        other runs or shapes are ignored. Each resumed execution's started model calls
        (`max_calls`) count as next_seq less its count_tokens calls (`call_headers`), so a
        runaway harness does not start over and a counting one loses no call."""
        head = f"{self.cfg.run}:"
        resumed: dict[str, int] = {}  # execution -> its count_tokens calls
        for event_id, headers in stored.items():
            execution, sep, seq = event_id.removeprefix(head).rpartition(":call:")
            if not event_id.startswith(head) or not sep or not (seq.isascii() and seq.isdigit()):
                continue
            ex = self.executions.setdefault(execution, _Execution(store=None))
            ex.next_seq = max(ex.next_seq, int(seq) + 1)
            counted = headers.get(REQUEST_KIND_HEADER) == "count_tokens"
            resumed[execution] = resumed.get(execution, 0) + counted
        for execution, counted in resumed.items():
            ex = self.executions[execution]
            ex.model_calls = max(ex.model_calls, ex.next_seq - counted)
        return len(resumed)

    def learn_context(self, err: ApiError) -> None:
        """Take the context length an engine's prompt-too-long refusal names, when it is news
        (none known, or a smaller one)."""
        context = err.context if err.code == "context_length_exceeded" else None
        if context is None or context < 2 or (self.context_tokens and context >= self.context_tokens):
            return
        log.warning("proxy.context.learnt", context_tokens=context, was=self.context_tokens)
        self.context_tokens = context

    def execution(self, execution: str) -> _Execution:
        """The state of a live execution, its call store made on its first call. Raises
        ApiError(403, `execution_finished`) once its `execution.finished` was seen: a call
        then (a harness's leftover process, a key reused after the run) would be recorded
        after the execution was scored, as a new root of its tree."""
        ex = self.executions.get(execution)
        if ex is None:
            ex = self.executions[execution] = _Execution(store=None)
        if ex.finished:
            raise finished_error(execution)
        if ex.store is None:
            ex.store = CallStore(self.tokenizer, check_drift=self.cfg.check_drift)
            ex.memo = MessageMemo()
            ex.bodies = BodyMemo()
        return ex

    def classify(self, ex: _Execution, headers: Any, req: ModelRequest, api: str) -> Classification:
        """Role and metadata of a call (gyre.serving.roles), with the execution's profile."""
        facts = CallFacts(api=api, headers={k.lower(): v for k, v in headers.items()}, model=req.model,
                          messages=req.messages, tools=len(req.tools or ()), json_output=req.json_output,
                          body_meta=req.body_meta)
        return classify(facts, ex.harness or self.cfg.harness or None)

    def admit(self, ex: _Execution) -> None:
        """Count a model call in; raises ApiError(429) over the concurrency bounds."""
        cfg = self.cfg
        if (cfg.max_active_calls and self.active >= cfg.max_active_calls) or (
                cfg.max_active_calls_per_execution and ex.active >= cfg.max_active_calls_per_execution):
            raise ApiError(429, "too many calls in flight; retry shortly", "rate_limit_error",
                           code="rate_limit_exceeded", headers={"Retry-After": str(cfg.retry_after_s)})
        self.active += 1
        ex.active += 1

    def release(self, ex: _Execution) -> None:
        self.active -= 1
        ex.active -= 1

    def spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def publish_later(self, out: Outgoing) -> None:
        """`publish(out)` in the background, starting at once, the call counted unsent from
        now: a drain that cancels the publish before it has started still spills it. Not
        held back to batch with other calls: a call still in memory is lost in a crash, and
        one reaching the bus after its execution's score is never trained (the builder
        finalises a group once every execution is scored; a 20-ms batch window made a
        reviewer's scorer 5-15 ms after the answer beat every call, 2026-12-06). Calls
        answered in one loop step still go out in one nats-py flush."""
        if self.bus is not None:
            self._unsent[out.event.event_id] = out
        self.spawn(self.publish(out))

    async def finish_calls(self, timeout_s: float) -> None:
        """Wait (≤ timeout_s) for the model calls being served (no new ones come: the
        listener is closed), then cancel the rest: each is published as `aborted` and its
        engine request aborted (`_abandon`), in the background `drain` waits for."""
        deadline = time.monotonic() + max(timeout_s, 0.0)
        while self.calls and time.monotonic() < deadline:
            await asyncio.wait(set(self.calls), timeout=deadline - time.monotonic())
        if self.calls:
            log.warning("proxy.stop.calls_cancelled", calls=len(self.calls))
            self.calls_cancelled = True
            cancelled = set(self.calls)
            for task in cancelled:
                task.cancel()
            await asyncio.wait(cancelled, timeout=1.0)

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
            self._unsent.clear()  # spilled once: a publish cancelled below leaves it unsent
        if self._background:
            _, pending = await asyncio.wait(set(self._background), timeout=max(deadline - time.monotonic(), 0.01))
            for task in pending:
                task.cancel()
            if pending:
                log.info("proxy.drain.cancelled", tasks=len(pending))
                await asyncio.wait(pending, timeout=0.2)

    # -- events
    def call_event(self, *, execution: str, seq: int, match: Match, sampling: SamplingParams,
                   result: EngineResult | None, status: str, total_s: float, cell: str, api: str = "chat",
                   role: str = "main", meta: dict | None = None) -> Outgoing:
        """The `call.completed` event of a call, with its token arrays inline, or in the
        object store once their JSON alone exceeds `object_threshold_bytes` (written straight
        from the arrays: a 680k-token prompt as tuples of Python ints took ≈ 16 ms of the
        event loop, its JSON from the array ≈ 5 ms).

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
        if stored and self._spilled:
            self.bus_back.set()
        if not stored:  # (too large for the bus: the resend keeps it aside, `_republish_one`)
            self.spill([out], "no PubAck within retry_timeout_s" if stored is False else "too large for the bus")

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
                self._spilled = True  # the next acknowledged publish sends them (`bus_back`)
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
        serving, so that `resume_seqs` sees their ids; by this one: `_resend_spilled`), until
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
        attempted = may_have_landed  # a publish attempt that failed may have landed
        ack_wait_s, one_publish_s = self.bus.config.timeout_s, self.bus.config.publish_bound_s()
        while True:
            try:
                event, data = _encoded(event)
                if tokens_json is None and len(data) > self.cfg.object_threshold_bytes:
                    t = event.tokens  # inline arrays whose event is still too large with the rest
                    tokens_json = _tokens_json(t.prompt_ids, t.completion_ids, t.logprobs)
                    event = dataclasses.replace(event, tokens=CallTokens(),
                                                tokens_ref=tokens_key(event.execution, event.seq))
                    data = encode(event)
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


# --------------------------------------------------------------------------- handlers


def finished_error(execution: str) -> ApiError:
    """The 403 for a call of an execution whose `execution.finished` was seen."""
    return ApiError(403, f"execution {execution!r} has finished; its key takes no more calls", "permission_error",
                    code="execution_finished")


def authenticate(state: ProxyState, request: web.Request) -> str:
    """The execution a request's key belongs to. Raises ApiError(401)."""
    key = key_of(request)
    if key is None:
        raise ApiError(401, "no API key: send 'Authorization: Bearer <key>' or 'x-api-key'",
                       "authentication_error", code="missing_api_key")
    execution = state.execution_of(key)
    if not execution:
        raise ApiError(401, "invalid API key", "authentication_error", code="invalid_api_key")
    return execution


def _render_error(exc: Exception, execution: str) -> ApiError:
    """The 400 for a request the template cannot render (`CallStore.attach` / `complete` /
    `prepare` raised)."""
    if isinstance(exc, ValueError):
        return ApiError(400, f"cannot render the conversation: {exc}", param="messages")
    # e.g. a template error on odd input: the request's fault
    log.warning("proxy.render.failed", execution=execution, error=repr(exc), exc_info=exc)
    return ApiError(400, f"cannot render the conversation: {exc!r}", param="messages")


def new_request_id() -> str:
    """A request id in the hosted APIs' shape: `req_<24 hex>` (`_name_response`)."""
    return "req_" + unique_hex()


def _refused(api: Api, err: ApiError, request_id: str) -> web.Response:
    """The error response for a request refused before it reached an engine (logged with
    its request id)."""
    log.info("proxy.request.refused", api=api.name, status=err.status, code=err.code, error=err.message[:200],
             request_id=request_id)
    return error_response(api, err)


def _internal_error(exc: Exception, execution: str, api: str, request_id: str) -> ApiError:
    """The 500 for a call that failed in the proxy before it reached an engine (logged)."""
    log.error("proxy.call.internal_error", execution=execution, api=api, request_id=request_id, error=repr(exc),
              exc_info=exc)
    return ApiError(500, f"internal error in the proxy: {type(exc).__name__}", "server_error", code="internal_error")


def _prepared_or_error(store: CallStore, pending: Pending) -> Prepared | Exception:
    """`store.prepare(pending)`, or what it raised (not MemoryError): run in the branch
    thread, so that only the request's own errors become a 400."""
    try:
        return store.prepare(pending)
    except MemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - handed to _render_error on the loop
        return exc


async def _match(store: CallStore, req: ModelRequest, auxiliary: bool, execution: str,
                 thread: concurrent.futures.Executor, remember: bool = True) -> Match:
    """TITO attachment of a request (a fresh root for auxiliary calls). A heavy one whose
    prompt needs whole conversations rendered (`gyre.serving.tito.Pending.heavy`: a branch of a long
    conversation, ≈ 0.2 s for 600k tokens; with a template other than gyre's, any long
    request) is rendered and encoded in `thread` (the proxy's `ProxyState.branch_thread()`),
    so the event loop goes on serving other calls. Raises ApiError(400) for a request the
    template cannot render. remember=False: a token count, which leaves the store's
    normalisation memo as it was (`gyre.serving.tito.CallStore.attach`)."""
    try:
        found = store.attach(req.messages, req.tools, fresh=auxiliary, remember=remember)
    except MemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - _render_error
        raise _render_error(exc, execution) from None
    if isinstance(found, Match):
        return found
    prepared = None
    if found.heavy:
        prepared = await asyncio.get_running_loop().run_in_executor(thread, _prepared_or_error, store, found)
    try:
        if isinstance(prepared, Exception):
            raise prepared
        return store.complete(found, prepared)
    except MemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - _render_error
        raise _render_error(exc, execution) from None


async def _parsed(request: web.Request, state: ProxyState,
                  parse: Callable[[Any, SamplingParams, MessageMemo | None], ModelRequest], history: str,
                  remember: bool = True) -> tuple[str, _Execution, ModelRequest]:
    """Authenticate, read the body within the size limit (its `history` array parsed where
    it is new: `_Execution.bodies`), parse it with the execution's memo; remember=False (a
    token count) reuses both memos and adds nothing to them. Raises ApiError (401, 403,
    400, 413, 415) for the caller to answer in its API's shape."""
    execution = authenticate(state, request)
    ex = state.execution(execution)  # a live execution: its store, memo and bodies exist
    body = await read_json(request, state.cfg.body_limit_bytes, request.app.get(RAW_BODIES, False),
                           functools.partial(ex.bodies.loads, field=history, remember=remember))
    try:
        return execution, ex, parse(body, state.defaults, ex.memo if remember else ex.memo.reader())
    except RecursionError:  # orjson reads ~1,000 levels; converting them in Python may not
        raise ApiError(400, "the request body nests too deeply") from None


async def serve_call(request: web.Request, api: Api,
                     parse: Callable[[Any, SamplingParams, MessageMemo | None], ModelRequest]) -> web.StreamResponse:
    """One model call through `api`: authenticate, parse, classify, admit, match, generate,
    answer, record, publish (module docstring)."""
    state: ProxyState = request.app[STATE]
    cfg = state.cfg
    t0 = time.monotonic()
    request[REQUEST_ID] = request_id = new_request_id()
    try:
        execution, ex, req = await _parsed(request, state, parse, api.history)
        if not req.model:
            req = dataclasses.replace(req, model=cfg.model_name)
        roles = state.classify(ex, request.headers, req, api.name)
        if cfg.max_calls and ex.model_calls >= cfg.max_calls:
            raise ApiError(400, f"this execution has reached its limit of {cfg.max_calls} model calls; stop here",
                           code="max_calls_exceeded")
        state.admit(ex)
    except ApiError as err:
        return _refused(api, err, request_id)
    task = asyncio.current_task()
    state.calls.add(task)
    try:
        return await _serve_admitted(request, state, api, req, execution, ex, roles, t0, request_id)
    finally:
        state.release(ex)
        state.calls.discard(task)


async def _serve_admitted(request: web.Request, state: ProxyState, api: Api, req: ModelRequest, execution: str,
                          ex: _Execution, roles: Classification, t0: float, request_id: str) -> web.StreamResponse:
    cfg = state.cfg
    auxiliary = roles.role == "auxiliary"
    store = ex.store
    ex.model_calls += 1  # before any await: concurrent calls see it (max_calls)
    try:
        match = await _match(store, req, auxiliary, execution, state.branch_thread())
    except ApiError as err:
        ex.model_calls -= 1
        return _refused(api, err, request_id)
    except Exception as exc:  # noqa: BLE001 - ours or the machine's (MemoryError): a 500 in the API's shape
        ex.model_calls -= 1
        return error_response(api, _internal_error(exc, execution, api.name, request_id))
    except BaseException:
        ex.model_calls -= 1
        raise
    req = _fit(req, len(match.prompt_ids), state.context_tokens)
    seq = ex.next_seq
    ex.next_seq += 1
    call_id = f"{execution}:{seq}"
    ctx = {"execution": execution, "call": call_id, "api": api.name, "role": roles.role,  # log context
           "request_id": request_id}
    common = dict(execution=execution, seq=seq, match=match, sampling=req.sampling, api=api.name, role=roles.role,
                  meta={**roles.meta, "request_id": request_id})
    reply = Reply(request, api, req.stream, cfg.keepalive_s, cfg.deliver_timeout_s)
    attempt = Attempt()
    result: EngineResult | None = None
    delivered = False
    prompt = match.prompt_ids  # (P,) int32, never mutated: the store keeps this array
    prompt_json = ex.prompt_json(match)
    start = StreamStart(rid=api.new_id(), created=int(time.time()), model=req.model, prompt_tokens=len(prompt))
    try:
        await reply.start(start, api.preamble(start, req) if req.stream else [])
        try:
            while True:
                if state.context_tokens and completion_room(state.context_tokens, len(prompt)) < 1:
                    raise context_exceeded(len(prompt), state.context_tokens)
                try:
                    result = await state.engines.generate(execution, orjson.Fragment(prompt_json), req.sampling,
                                                          call_id, attempt, len(prompt))
                    if ex.finished:  # while it generated: its answer would land after the score
                        raise finished_error(execution)
                    break
                except ApiError as err:
                    # An engine's prompt-too-long names its context: learn it, and when the prompt
                    # fits with a lower cap (sent before the context was known), go again capped.
                    state.learn_context(err)
                    fitted = _fit(req, len(prompt), state.context_tokens) if err.context else req
                    if fitted is req:
                        raise
                    req = fitted
                    common["sampling"] = req.sampling
        except ApiError as err:
            log.warning("proxy.call.failed", **ctx, status=err.status, error=err.message[:300])
            resp = await reply.fail(err)
            state.publish_later(state.call_event(**common, result=None, status="error",
                                                 total_s=time.monotonic() - t0, cell=attempt.cell))
            return resp
        text, hit = state.decode(result.output_ids), result.stop_string
        if hit is not None and hit in req.sampling.stop and hit in text:
            text = text.partition(hit)[0]  # the answer ends before the string, as hosted APIs do
        else:
            hit = None
        parsed = parse_completion(text, id_prefix=api.tool_id_prefix(f"{cfg.run}:{call_id}"),
                                  cut=(result.finish == "length" or hit is not None) and bool(req.tools))
        answer = Answer(content=parsed.content, reasoning=parsed.reasoning, tool_calls=parsed.tool_calls,
                        finish=result.finish, prompt_tokens=len(prompt), completion_tokens=len(result.output_ids),
                        rid=start.rid, created=start.created, stop_sequence=hit,
                        reasoning_tokens=_reasoning_tokens(result.output_ids, cut="</think>" not in text)
                        if parsed.reasoning else 0,
                        token_logprobs=tuple(zip(state.token_bytes(result.output_ids), result.logprobs))
                        if req.options.get("logprobs") else None)
        # Built before the answer goes out: an answer that cannot be recorded is never sent.
        event = state.call_event(**common, result=result, status="ok", total_s=time.monotonic() - t0,
                                 cell=result.cell)
        resp = await reply.send(api.render(answer, req))
        delivered = True
        state.publish_later(event)
        # No await between delivery and recording: the harness's next call sees this one.
        if not auxiliary:
            store.record(match, call=call_id, seq=seq, answer=internal_message(answer),
                         completion_ids=result.output_ids)
            if ex.store is store:  # not when the execution finished meanwhile (nothing would free it)
                ex.remember(match, call_id, prompt_json, result.output_ids)
        # Debug: `call.completed` is the call's record; at info this line cost ~3% of a saturated proxy.
        log.debug("proxy.call.recorded", **ctx, seq=seq, parent=match.parent.call if match.parent else None,
                  prefix_len=match.prefix_len, extended=match.extended, prompt_tokens=len(prompt),
                  new_prompt_tokens=len(prompt) - match.prefix_len, completion_tokens=len(result.output_ids),
                  finish=result.finish, drift=match.drift, cell=result.cell, stream=req.stream,
                  queue_s=round(result.queue_s, 4), engine_s=round(result.engine_s, 4),
                  total_s=round(time.monotonic() - t0, 4))
        return resp
    except (asyncio.CancelledError, ConnectionResetError) as exc:
        if not delivered:
            stopped = isinstance(exc, asyncio.CancelledError) and state.calls_cancelled
            reply.cut()
            log.info("proxy.call.stopped" if stopped else "proxy.call.client_gone", **ctx, seq=seq)
            _abandon(state, attempt, common, result, t0)
            if stopped and not reply.handed_over:  # the harness hears why: a 503, or an error event
                asyncio.current_task().uncancel()
                with contextlib.suppress(ConnectionResetError):  # (gone meanwhile: nothing to tell)
                    return await reply.fail(STOPPED)
        raise
    except Exception as exc:  # noqa: BLE001 - a defect of ours: answer in the API's shape, record the call
        log.exception("proxy.call.internal_error", **ctx, error=repr(exc), delivered=delivered)
        if delivered:  # published already (only recording failed): the next call attaches as a branch
            return resp
        state.publish_later(state.call_event(**common, result=None, status="error",
                                             total_s=time.monotonic() - t0, cell=attempt.cell))
        return await reply.fail(ApiError(500, f"internal error in the proxy: {type(exc).__name__}", "server_error",
                                         code="internal_error"))
    finally:
        if ex.finished:  # picked after `execution.finished` forgot it: its sticky cell would count for good
            state.router.forget(execution)
        await reply.stop_keepalive()


def _reasoning_tokens(output_ids: list[int], cut: bool) -> int:
    """Completion tokens up to and including the first `</think>` id. cut: the completion's
    text has no `</think>` (its reasoning was cut short while thinking:
    `gyre.serving.chat.parse_completion`), so all of them; 0 when the text has one but not as that
    id (sampled in pieces: where the reasoning ends in tokens is not known)."""
    if cut:
        return len(output_ids)
    try:
        return output_ids.index(THINK_END) + 1
    except ValueError:
        return 0


def _fit(req: ModelRequest, prompt_tokens: int, context: int) -> ModelRequest:
    """`req` with its completion cap at most the room a `context`-token window leaves
    (`completion_room`; unchanged when the context is 0, not known, or the prompt does not
    fit: that is refused before any engine)."""
    room = completion_room(context, prompt_tokens) if context else 0
    if 0 < room < req.sampling.max_tokens:
        return dataclasses.replace(req, sampling=dataclasses.replace(req.sampling, max_tokens=room))
    return req


STOPPED = ApiError(503, "the proxy stopped before this call was answered", "server_error", code="proxy_stopping")
"""What a call the stop cancelled (`ProxyState.finish_calls`) answers: a 503 in the API's
shape, or its error event where the stream had opened; a non-streamed answer whose 200
went out with keep-alive newlines is cut (`Reply.fail`)."""


def _abandon(state: ProxyState, attempt: Attempt, common: dict, result: EngineResult | None, t0: float) -> None:
    """The harness went away, or the stop cancelled the call: publish it as `aborted` (never
    trained; counted unsent at once: the abort may wait on a hung engine past a shutdown's
    drain), abort the engine request in the background."""
    state.publish_later(state.call_event(**common, result=result, status="aborted", total_s=time.monotonic() - t0,
                                         cell=attempt.cell))
    if attempt.client is not None and attempt.rid:
        state.spawn(state.engines.abort_upstream(attempt.client, attempt.rid))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await serve_call(request, CHAT, parse_chat_request)


async def responses(request: web.Request) -> web.StreamResponse:
    return await serve_call(request, RESPONSES, parse_responses_request)


async def messages(request: web.Request) -> web.StreamResponse:
    return await serve_call(request, MESSAGES, parse_messages_request)


def _parse_count_tokens(body: Any, defaults: SamplingParams, memo: MessageMemo | None) -> ModelRequest:
    """A count_tokens body as a Messages body, without `stop_sequences` (it generates nothing)."""
    if isinstance(body, dict) and "stop_sequences" in body:
        body = {k: v for k, v in body.items() if k != "stop_sequences"}
    return parse_messages_request(body, defaults, memo)


async def _count(request: web.Request, api: Api,
                 parse: Callable[[Any, SamplingParams, MessageMemo | None], ModelRequest]) -> int | web.Response:
    """The prompt length a model call with this body would have in its execution: attached
    as the call would be (an extension reuses the ids the policy sampled, so the count is
    its `usage` input tokens to the token), published as an `auxiliary` call holding the
    whole prompt (a root: it shapes no tree). Counted in the concurrency bounds like a
    model call (its rendering may take the branch thread for a while): over them, a 429.
    Returns the count, or the error response in `api`'s shape."""
    state: ProxyState = request.app[STATE]
    t0 = time.monotonic()
    execution = ""
    request[REQUEST_ID] = request_id = new_request_id()
    try:
        execution, ex, req = await _parsed(request, state, parse, api.history, remember=False)
        roles = state.classify(ex, request.headers, req, "count_tokens")
        state.admit(ex)
        try:
            match = await _match(ex.store, req, False, execution, state.branch_thread(), remember=False)
        finally:
            state.release(ex)
        if ex.finished:  # while it was rendered: its record would land after the score
            raise finished_error(execution)
    except ApiError as err:
        return _refused(api, err, request_id)
    except Exception as exc:  # noqa: BLE001 - ours or the machine's (MemoryError): a 500 in the API's shape
        return error_response(api, _internal_error(exc, execution, "count_tokens", request_id))
    seq = ex.next_seq
    ex.next_seq += 1
    root = dataclasses.replace(match, parent=None, prefix_len=0, extended=False, drift=0)
    state.publish_later(state.call_event(
        execution=execution, seq=seq, match=root, sampling=req.sampling, result=None, status="ok",
        total_s=time.monotonic() - t0, cell="", api=api.name, role=roles.role,
        meta={**roles.meta, "request_id": request_id}))
    return len(match.prompt_ids)


async def count_tokens(request: web.Request) -> web.Response:
    """Anthropic's `POST /v1/messages/count_tokens`: `{"input_tokens": n}` (`_count`)."""
    n = await _count(request, MESSAGES, _parse_count_tokens)
    return n if isinstance(n, web.Response) else web.json_response({"input_tokens": n})


async def responses_input_tokens(request: web.Request) -> web.Response:
    """OpenAI's `POST /v1/responses/input_tokens` (the SDK's `responses.input_tokens.count`):
    `{"object": "response.input_tokens", "input_tokens": n}` (`_count`)."""
    n = await _count(request, RESPONSES, parse_responses_request)
    return n if isinstance(n, web.Response) else web.json_response({"object": "response.input_tokens",
                                                                    "input_tokens": n})


async def response_not_stored(request: web.Request) -> web.Response:
    """`/v1/responses/{id}` (retrieve, delete, cancel, input items): 404, the proxy stores
    no responses (Codex CLI sends `store: false` and the whole conversation each call).
    `/v1/responses/compact` is an endpoint, not an id: answered as one not served."""
    if request.path in MODEL_PATHS or request.match_info["rid"] == "compact":  # input_tokens: not a POST
        return await not_found(request)
    rid = request.match_info["rid"].split("/", 1)[0]
    return error_response(RESPONSES, ApiError(404, f"Response with id {rid[:200]!r} not found: this proxy stores no "
                                                   "responses", code="response_not_found"))


def _model_entry(name: str) -> dict:
    """A model object both OpenAI's (`id`, `object`, `created`, `owned_by`) and Anthropic's
    (`id`, `type`, `display_name`, `created_at`) SDKs read."""
    return {"id": name, "object": "model", "type": "model", "display_name": name, "created": 0,
            "created_at": "1970-01-01T00:00:00Z", "owned_by": "gyre"}


async def models(request: web.Request) -> web.Response:
    """The one model (`GET /v1/models`)."""
    state: ProxyState = request.app[STATE]
    try:
        authenticate(state, request)
    except ApiError as err:
        return error_response(_api_of(request), err)
    name = state.cfg.model_name
    return web.json_response({"object": "list", "data": [_model_entry(name)], "has_more": False, "first_id": name,
                              "last_id": name})


async def model(request: web.Request) -> web.Response:
    """`GET /v1/models/{id}`: any name, as every call accepts any model name (it is served
    by the policy)."""
    try:
        authenticate(request.app[STATE], request)
    except ApiError as err:
        return error_response(_api_of(request), err)
    return web.json_response(_model_entry(request.match_info["model"]))


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok", "run": request.app[STATE].cfg.run})


async def root(request: web.Request) -> web.Response:
    return web.Response(text="gyre proxy\n")


def _api_of(request: web.Request) -> Api:
    """Whose error shape a request outside the model routes gets: Anthropic's for its paths
    and for its SDK's headers (`anthropic-version`, `x-api-key`), else OpenAI's."""
    anthropic = request.path.startswith(("/v1/messages", "/messages")) or "anthropic-version" in request.headers \
        or "x-api-key" in request.headers
    return MESSAGES if anthropic else CHAT


MODEL_PATHS = frozenset(prefix + path for prefix in ("/v1", "") for path in (
    "/chat/completions", "/responses", "/messages", "/messages/count_tokens", "/responses/input_tokens"))


async def not_found(request: web.Request) -> web.Response:
    """404 `unknown_url` in the caller's shape; a model path asked with another method than
    POST is 405 with `Allow: POST` (RFC 9110 §15.5.6)."""
    if request.path in MODEL_PATHS:
        return error_response(_api_of(request), ApiError(
            405, f"{request.method} is not allowed on {request.path}; use POST", code="method_not_allowed",
            headers={"Allow": "POST"}))
    return error_response(_api_of(request), ApiError(404, f"unknown endpoint {request.method} {request.path}",
                                                     "not_found_error", code="unknown_url"))


STATE = web.AppKey("state", ProxyState)
RAW_BODIES = web.AppKey("raw_bodies", bool)
REQUEST_ID = web.RequestKey("request_id", str)
"""Key of a model call's request id on its `web.Request` (`_name_response`)."""


async def _name_response(request: web.Request, response: web.StreamResponse) -> None:
    """Every response carries a request id, as the hosted APIs send one: `request-id`
    (Anthropic; its SDK's `_request_id` and errors' `request_id`) and `x-request-id`
    (OpenAI), the same `req_<24 hex>`. A model call's id is also in its `call.completed`
    `meta.request_id` and its log lines, so an id a harness prints leads to the call."""
    rid = request.get(REQUEST_ID) or new_request_id()
    response.headers["request-id"] = response.headers["x-request-id"] = rid


def make_app(state: ProxyState) -> web.Application:
    """The proxy's aiohttp application. Serve it as `start` does: `handler_cancellation=True`
    (a harness that goes away aborts its call upstream) and `auto_decompress=False` with
    `app[RAW_BODIES] = True` (bodies decoded here, bounded, unsupported codings → 415)."""
    app = web.Application(client_max_size=state.cfg.body_limit_bytes)
    app[STATE] = state
    app.on_response_prepare.append(_name_response)
    for prefix in ("/v1", ""):
        app.router.add_post(prefix + "/chat/completions", chat_completions)
        app.router.add_post(prefix + "/responses", responses)
        app.router.add_post(prefix + "/messages", messages)
        app.router.add_post(prefix + "/messages/count_tokens", count_tokens)
        app.router.add_post(prefix + "/responses/input_tokens", responses_input_tokens)
        app.router.add_route("*", prefix + "/responses/{rid:.+}", response_not_stored)
        app.router.add_get(prefix + "/models", models)
        app.router.add_get(prefix + "/models/{model:.+}", model)  # a raw "Qwen/Qwen3-8B" too
    app.router.add_get("/health", health)
    app.router.add_get("/", root)
    app.router.add_route("*", "/{tail:.*}", not_found)
    return app


IDLE_CLOSE_S = 75.0
"""Seconds a connection may wait without a whole request head (idle between calls, or a
client that sent nothing or part of its headers) before the proxy closes it: aiohttp's
keep-alive timeout, as `web.run_app` sets it (its `AppRunner` default is an hour, which
let a local process hold connections until the proxy ran out of file descriptors). The
SDKs' own idle timeouts are shorter (httpx 5 s, undici 4 s). A body that stalls once its
head has come: `handlers.proxy.http.BODY_READ_S`."""


async def start(state: ProxyState, reuse_port_of: str = "") -> tuple[web.AppRunner, str]:
    """Serve `make_app(state)` on cfg.host:cfg.port; returns the runner and the base URL.
    With cfg.port 0 and `reuse_port_of` (the URL a predecessor of the run served at, from
    its url file), that port is taken when it is free, so that harnesses started before a
    proxy restart reach the new proxy when they retry; a free port otherwise."""
    app = make_app(state)
    app[RAW_BODIES] = True
    # Model calls are finished or cancelled before the runner's cleanup (`run`); what else
    # is still being answered then (a count_tokens) gets this long, twice (aiohttp's two waits).
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0,
                           auto_decompress=False, keepalive_timeout=IDLE_CLOSE_S)
    await runner.setup()
    host = state.cfg.host
    if not state.cfg.port and (earlier := _port_of(reuse_port_of, host)):
        site = web.TCPSite(runner, host, earlier)
        try:
            await site.start()
            return runner, f"http://{host}:{earlier}"
        except OSError as exc:  # something else listens there now
            await site.stop()
            log.warning("proxy.port.not_reused", port=earlier, error=str(exc))
    await web.TCPSite(runner, host, state.cfg.port).start()
    return runner, f"http://{host}:{runner.addresses[0][1]}"


def _port_of(url: str, host: str) -> int:
    """The port of `url` when it is an http URL on `host`, else 0."""
    try:
        parsed = urllib.parse.urlsplit(url)
        port = parsed.port or 0
    except ValueError:
        return 0
    return port if parsed.scheme == "http" and parsed.hostname == host.strip("[]") else 0


def vocab_size(model_dir: str) -> int:
    """Rows of the policy's embedding table, the bound on the token ids an engine may
    answer: the checkpoint's `config.json` `vocab_size` (or its `text_config`'s), gyre's
    padded Qwen3 vocabulary (151,936) for the built-in tokenizer; 2**31 (int32, no other
    bound) when the checkpoint's config does not say."""
    if not model_dir:
        from gyre.serving.tokenizer import VOCAB_SIZE

        return VOCAB_SIZE
    try:
        config = orjson.loads((Path(model_dir) / "config.json").read_bytes())
    except (OSError, ValueError):
        return 2**31
    for c in (config, config.get("text_config") if isinstance(config, dict) else None):
        if isinstance(c, dict) and type(c.get("vocab_size")) is int and c["vocab_size"] > 0:
            return c["vocab_size"]
    return 2**31


def load_tokenizer(model_dir: str) -> Any:
    if model_dir:
        from gyre.serving.model import load_tokenizer as from_checkpoint

        return from_checkpoint(model_dir)
    from gyre.serving.tokenizer import build_tokenizer

    return build_tokenizer()


async def run(cfg: Config, stop: asyncio.Event,
              on_started: Callable[[ProxyState, str], None] | None = None) -> None:
    """Serve until `stop`; then finish in-flight calls and publishes within shutdown_grace_s.

    on_started(state, url) is called once the listener is bound (embedding and tests)."""
    from bus import Bus

    tokenizer = load_tokenizer(cfg.model_dir)
    fast_encoder(tokenizer)  # build tiktoken's tables now, not on the first call
    bus = None
    if cfg.nats_url:
        bus = await Bus.connect(cfg.nats_url, token=cfg.nats_token, run=cfg.run, name="proxy", stop=stop)
    session = runner = replay = state = resend = lock = None
    thresholds = gc.get_threshold()
    tuned = False
    try:
        if bus is not None:
            await bus.ensure_streams()
        session = make_session()
        earlier_url = url_in(Path(cfg.url_file)) if cfg.url_file else ""
        if earlier_url and (other := await serving_proxy(session, earlier_url, cfg.run)):
            from handlers.daemon import FatalError

            raise FatalError(f"a proxy of run {cfg.run} already serves at {other} ({cfg.url_file}); one proxy "
                             "per run: start this one once that one has exited")
        if cfg.url_file:
            Path(cfg.url_file).parent.mkdir(parents=True, exist_ok=True)  # a proxy may start before the runner
            lock = _run_lock(Path(cfg.url_file).with_suffix(".lock"), cfg.run)
        state = ProxyState(cfg, tokenizer, session, bus)
        # Before serving: what an earlier proxy could not publish goes out, and a restarted
        # proxy goes on after its predecessor's seqs (those included).
        if bus is not None and not await _resumed(state, bus, stop):
            return
        if bus is not None:
            # The run's routes, cells and finished executions are known before the first call:
            # a finished execution's key must not be served while the replay catches up.
            caught_up = asyncio.Event()
            replay = asyncio.create_task(bus.replay(REPLAYED, state.handle_event, stop=stop, caught_up=caught_up))
            if not await _caught_up(caught_up, replay, stop):
                return
            resend = asyncio.create_task(_resend_spilled(state, stop))
        runner, url = await start(state, reuse_port_of=earlier_url)
        if cfg.tune_gc:
            gc.collect()
            gc.freeze()
            gc.set_threshold(*GC_THRESHOLDS)
            tuned = True
        if cfg.url_file:
            path = Path(cfg.url_file)
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(orjson.dumps({"url": url, "v1": url + "/v1"}))
            tmp.replace(path)
        log.info("proxy.started", url=url, engine_url=cfg.engine_url or None, bus=bool(bus))
        if on_started is not None:
            on_started(state, url)
        await stop.wait()
    finally:
        # One budget for the whole stop (Config.shutdown_grace_s): calls, then publishes and spills.
        end = time.monotonic() + cfg.shutdown_grace_s
        if resend is not None:
            resend.cancel()
        if state is not None:
            state.engines.stop()
        if runner is not None:
            for site in list(runner.sites):
                await site.stop()  # no new connections
            if runner.server is not None:
                runner.server.pre_shutdown()  # nor requests: idle keep-alive connections close
            if state is not None:
                await state.finish_calls(end - cfg.stop_reserve_s() - time.monotonic())
            await runner.shutdown()
            await runner.cleanup()
        if state is not None:
            await state.drain(end - cfg.close_reserve_s() - time.monotonic())
            state.close()
        if replay is not None:
            if not stop.is_set():
                replay.cancel()  # a start that failed: nothing else ends it
            await asyncio.wait({replay}, timeout=max(end - time.monotonic(), 0.05))
            if replay.done() and not replay.cancelled() and replay.exception() is not None:
                log.info("proxy.replay.stopped", error=repr(replay.exception()))
        if session is not None:
            await session.close()
        if bus is not None:
            await bus.close(timeout_s=max(end - time.monotonic(), 0.2))
        if tuned:
            gc.set_threshold(*thresholds)
            gc.unfreeze()
        if lock is not None:
            lock.close()  # after the drain and its spill: the next proxy republishes them
        log.info("proxy.stopped")


def _run_lock(path: Path, run: str) -> Any:
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


async def _caught_up(caught_up: asyncio.Event, replay: asyncio.Task, stop: asyncio.Event) -> bool:
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


async def _resend_spilled(state: ProxyState, stop: asyncio.Event) -> None:
    """While serving: publish what this proxy spilled once the bus takes events again
    (`ProxyState.republish`: as soon as a publish is acknowledged after a spill or the
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
        state.bus.on_reconnect(lambda: state.bus_back.set() if state._spilled else None)
    while path is not None and not stop.is_set():
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(wait_any([stop, state.bus_back]), wait_s)
        if stop.is_set():
            return
        state.bus_back.clear()
        if path.exists() or state.sending_path().exists():
            state._spilled = False
            try:
                known = await state.bus.stored_ids("call.completed", stop=stop)
                if known is None:  # stopped
                    return
                await state.republish(stop, known=set(known))
                wait_s = SPILL_RETRY_S
            except Exception as exc:  # noqa: BLE001 - kept on disk; tried again later and at the next start
                state._spilled = True
                # Each try reads every stored call id of the run: back off while it keeps failing.
                wait_s = min(wait_s * 2, SPILL_RETRY_MAX_S)
                log.warning("proxy.spill.republish_failed", error=repr(exc), retry_in_s=wait_s)


async def _resumed(state: ProxyState, bus: Any, stop: asyncio.Event) -> bool:
    """Before serving: publish what an earlier proxy spilled and is not stored already
    (`ProxyState.republish`: a spilled call whose PubAck alone was lost is not stored a
    second time, also after JetStream's duplicate window), then resume the executions'
    seqs from the run's stored `call.completed` ids, those included
    (`ProxyState.resume_seqs`). False when `stop` is set meanwhile (the proxy then never
    serves). Raises what `Bus.stored_ids` and `republish` raise: a proxy that cannot read
    the ids or publish its predecessor's calls must not serve."""
    t0 = time.monotonic()
    stored = await bus.stored_ids("call.completed", stop=stop)
    if stored is None or stop.is_set():
        return False
    published = await _unless_stopped(state.republish(stop, known=set(stored)), stop)
    if published is None or stop.is_set():
        return False
    log.info("proxy.seqs.resumed", executions=state.resume_seqs({**stored, **published}),
             calls=len(stored) + len(published), seconds=round(time.monotonic() - t0, 3))
    return True


def config_from_context(ctx: Any, args: Any) -> Config:
    """The proxy of a run: the recipe's sampling, `harness.max_calls` and `[proxy]` table
    (limits and timeouts, `gyre.config.ProxySection`). Its context window is the recipe's `engine.max_context_tokens`
    when the run's cells serve it; an engine given by `--engine-url` says its own."""
    r = ctx.recipe
    return Config(run=ctx.run, key_secret=ctx.key_secret, port=args.port, model_dir=str(ctx.checkpoint()),
                  nats_url=ctx.nats_url, nats_token=ctx.nats_token, engine_url=args.engine_url or "",
                  temperature=r.sampling.temperature, top_p=r.sampling.top_p, top_k=r.sampling.top_k,
                  max_completion_tokens=r.sampling.max_tokens, max_calls=r.harness.max_calls,
                  context_tokens=0 if args.engine_url else r.engine.max_context_tokens,
                  url_file=str(ctx.run_dir / "proxy.json"), spill_file=str(ctx.run_dir / "proxy-unpublished.jsonl"),
                  **dataclasses.asdict(r.proxy))


def main(argv: list[str] | None = None) -> NoReturn:
    """The proxy process's entry point (`gyre proxy`): serves until stopped, then ends the
    process with the daemon's exit status, without the interpreter's teardown. That
    teardown frees every execution's call store object by object (≈ 1 s with a few dozen
    here, more with thousands), time `shutdown_grace_s` has no room for, and nothing is
    left to do by then: the spill file is synced, the bus and the listener are closed."""
    from handlers.daemon import daemon_main

    def extra(p: Any) -> None:
        p.add_argument("--port", type=int, default=0, help="listening port on 127.0.0.1 (0 = free port)")
        p.add_argument("--engine-url", default="", help="engine used while no rollout cell is known")

    status = daemon_main("proxy", "model endpoint for agent harnesses (OpenAI Chat and Responses, Anthropic "
                                  "Messages) with token-in/token-out capture", config_from_context, run, argv,
                         extra_args=extra)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # (a closed pipe: nothing more can be said)
            stream.flush()
    os._exit(status)


if __name__ == "__main__":
    main()
