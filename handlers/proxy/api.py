"""What the proxy's API shapes share: errors, the parsed request, the answer, SSE framing.

Contract: each wire API (OpenAI Chat Completions, OpenAI Responses, Anthropic Messages)
is an `Api` object (handlers/proxy/openai.py, handlers/proxy/responses.py,
handlers/proxy/anthropic.py) that
- parses a request body into a `ModelRequest` whose `messages`/`tools` are in the internal
  form `gyre.serving.chat.render` and `gyre.serving.tito` take (OpenAI chat messages: role, content string,
  tool_calls [{id, type, function{name, arguments JSON text}}], tool_call_id,
  reasoning_content; tools `{"type": "function", "function": {name, description, parameters}}`),
- renders an `Answer` as its own non-streaming body or SSE frames,
- renders an `ApiError` in its own error shape (`error_body`, `sse_error`).
The assistant message recorded for TITO is `internal_message(answer)` for every API, so
a harness that echoes our answer back in its own API's form converts to the same message.
Every API's tool results pass `tool_results_in_call_order`: a result for no call of the
request's history is a 400 naming the id, and results are rendered in the order of the
calls they answer.

Pure: no aiohttp here (handlers/proxy/call.py and app.py do the HTTP).
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import re
import zlib
from collections.abc import Callable, Iterable
from typing import Any

import orjson

from gyre.serving.chat import ToolCall
from gyre.serving.normalise import equal_prefix_len
from gyre.serving.tokenizer import parse_stop
from schemas.call import SamplingParams


MAX_MESSAGES = 100_000
"""Messages (Responses: input items) one request may hold; beyond, a 400. The hosted
Messages API's own limit ("a limit of 100,000 messages in a single request"); it bounds how
long one request's per-message work (conversion, `gyre.serving.tito` normalisation, ≈ 10 µs a
message) holds the event loop, which the body limit alone left at seconds for a 64-MiB
body of tiny messages."""


def check_count(items: list, param: str) -> None:
    """Raises ApiError(400) when `items` (a request's messages or input items) exceed
    `MAX_MESSAGES`."""
    if len(items) > MAX_MESSAGES:
        raise ApiError(400, f"'{param}' holds {len(items):,} entries; at most {MAX_MESSAGES:,} in a single request",
                       param=param)


class ApiError(Exception):
    """An error answered to the harness, rendered in the API's own shape by `Api.error_body`.

    status: HTTP status. type: OpenAI/Anthropic error type (`invalid_request_error`,
    `authentication_error`, `rate_limit_error`, `overloaded_error`, `server_error`, …).
    code/param: OpenAI's fields (Anthropic's shape drops them). headers: extra response
    headers (e.g. `Retry-After` on 429). context: the context length in tokens a
    `context_length_exceeded` error names (None otherwise, or when not known).
    """

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param
        self.headers = dict(headers or {})
        self.context: int | None = None

    def body(self) -> dict:
        """OpenAI's error shape `{"error": {"message", "type", "param", "code"}}`."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def completion_room(context: int, prompt_tokens: int) -> int:
    """Completion tokens a prompt may be given in a `context`-token window, counted as SGLang
    counts it (≤ 0: the prompt is refused). SGLang serves a prompt shorter than its scheduler's
    `max_req_input_len` = `max_req_len` − 5, with `max_req_len` = context − 1 (so at most
    context − 7 tokens; longer: "Input length … exceeds the maximum allowed length …"), and
    caps `max_new_tokens` at `max_req_len` − 1 − prompt = context − 2 − prompt (scheduler
    `validate_input_length` and its cap; its tokenizer manager also refuses prompt +
    max_new_tokens ≥ context)."""
    return context - 2 - prompt_tokens if prompt_tokens <= context - 7 else 0


def context_exceeded(prompt_tokens: int | None, context: int | None, detail: str = "") -> ApiError:
    """The 400 a prompt that leaves no room in a `context`-token window gets (`completion_room`
    < 1), worded so that every harness recognises it and compacts or shortens its
    conversation instead of failing: Anthropic's "prompt is too long: N tokens > M maximum"
    (M = the longest prompt that fits, context − 7), OpenAI's "This model's maximum context
    length is C tokens" with code `context_length_exceeded` (what Codex CLI and litellm, hence
    mini-swe-agent, test for). `detail`: an engine's own words, appended. The error's
    `context` is `context`."""
    if context is not None:
        message = f"prompt is too long: {prompt_tokens if prompt_tokens is not None else 'more'} tokens > " \
                  f"{context - 7} maximum. This model's maximum context length is {context} tokens"
        message += f"; your messages resulted in {prompt_tokens} tokens." if prompt_tokens is not None else "."
    else:
        message = "prompt is too long for the engine's context."
    if detail:
        message += f" ({detail[:300]})"
    err = ApiError(400, message, code="context_length_exceeded", param="messages")
    err.context = context
    return err


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ModelRequest:
    """A model call in the internal form, whatever API it arrived through.

    api: `chat` | `responses` | `messages`. messages/tools: internal form (module docstring);
    tools None = no tools. stream: answer as SSE. sampling: what the engine will use (and the
    event records). model: the name the harness asked for (echoed, never checked).
    json_output: the request asks for a JSON-schema-shaped answer (title calls).
    options: API-specific switches (`include_usage`, the echoed request fields, …).
    body_meta: harness identity found in the body (e.g. Anthropic `metadata.user_id`'s
    session id), for `gyre.serving.roles`.
    """

    api: str
    messages: list[dict]
    tools: list[dict] | None
    stream: bool
    sampling: SamplingParams
    model: str
    json_output: bool = False
    options: dict = dataclasses.field(default_factory=dict)
    body_meta: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Answer:
    """A completion turned into an answer.

    content: visible text. reasoning: thinking text or None. tool_calls: parsed calls (ids
    already in the API's style). finish: the engine's `stop` | `length`. prompt_tokens /
    completion_tokens: lengths of the prompt sent and the completion sampled (stop token
    included). rid: the answer's id (`chatcmpl-…`, `resp_…`, `msg_…`). created: unix seconds.
    stop_sequence: the request's stop string the completion ended on (the text is cut
    before it), None otherwise. reasoning_tokens: the completion's tokens up to and
    including `</think>` (0 without reasoning): OpenAI's `reasoning_tokens` in usage.
    token_logprobs: when the request asked for log-probs (Chat Completions `logprobs`),
    (C,) pairs (the token's bytes, its behaviour log-prob as recorded: natural log, under
    the engine's sampling distribution at the call's temperature, T = 1 for greedy
    decoding at temperature 0; `gyre.serving.engine`), one per sampled token, stop token
    included; None otherwise.
    """

    content: str
    reasoning: str | None
    tool_calls: tuple[ToolCall, ...]
    finish: str
    prompt_tokens: int
    completion_tokens: int
    rid: str
    created: int
    stop_sequence: str | None = None
    reasoning_tokens: int = 0
    token_logprobs: tuple[tuple[bytes, float], ...] | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class StreamStart:
    """What a stream's first frames need before the answer exists (the prompt is known)."""

    rid: str
    created: int
    model: str
    prompt_tokens: int


_ID_PREFIX = os.urandom(6).hex()
_ID_COUNTER = itertools.count()


def unique_hex() -> str:
    """24 hex digits unique among this process's calls and, by a random per-process
    prefix, across processes and restarts (response and request ids; a counter, not a
    `uuid4` per call: that is a getrandom syscall each time)."""
    return f"{_ID_PREFIX}{next(_ID_COUNTER):012x}"


class Api:
    """One wire API. Subclasses override the rendering methods."""

    name = "chat"
    history = "messages"
    """The body's array that holds the conversation (`handlers.proxy.body.BodyMemo`)."""
    keepalive = b": keep-alive\n\n"
    """SSE frame sent while a streamed call waits."""

    def new_id(self) -> str:
        raise NotImplementedError

    def tool_id_prefix(self, key: str) -> str:
        """Tool-call id prefix for a call key; ids are `<prefix>_<i>`."""
        raise NotImplementedError

    def error_body(self, err: ApiError) -> dict:
        return err.body()

    def sse_error(self, err: ApiError, start: StreamStart | None = None) -> bytes:
        """The frame that ends a stream whose call failed after it was opened."""
        return sse(err.body())

    def preamble(self, start: StreamStart, req: ModelRequest) -> list[bytes]:
        """SSE frames that open a stream, ahead of the answer's (`handlers.proxy.http.Reply`)."""
        return []

    def render(self, answer: Answer, req: ModelRequest) -> dict | list[bytes]:
        """The non-streaming body (a dict for `orjson.dumps`: it may hold `orjson.Fragment`s,
        JSON text embedded as written) or the stream's remaining SSE frames, through the
        stream's last frame (Chat's `data: [DONE]`)."""
        raise NotImplementedError


def internal_message(answer: Answer) -> dict:
    """The assistant message TITO records for an answer (chat form; content "" when empty)."""
    msg: dict[str, Any] = {"role": "assistant", "content": answer.content}
    if answer.reasoning:
        msg["reasoning_content"] = answer.reasoning
    if answer.tool_calls:
        msg["tool_calls"] = [{"id": tc.id, "type": "function", "function": {"name": tc.name, "arguments": tc.arguments}}
                             for tc in answer.tool_calls]
    return msg


# --------------------------------------------------------------------------- tool results

_ORPHAN = {
    "chat": ("Invalid parameter: 'tool_call_id' of {id!r} not found in 'tool_calls' of an earlier assistant "
             "message: a message with role 'tool' must answer a tool call of this conversation", "messages"),
    "responses": ("No tool call found for function call output with call_id {id!r}: an output must answer a "
                  "function_call (or custom_tool_call) item of this input", "input"),
    "messages": ("unexpected `tool_use_id` found in `tool_result` blocks: {id!r}. Each `tool_result` block must "
                 "have a corresponding `tool_use` block in an earlier assistant message", "messages"),
}


def tool_results_in_call_order(messages: list[dict], api: str) -> list[dict]:
    """The internal `messages` of an `api` request (`chat`, `responses`, `messages`) with
    every tool result checked against the request's own history and each run of results
    put in the order of the calls they answer.

    - A `tool` message whose `tool_call_id` is empty, missing, or names no tool call of an
      earlier assistant message in the request is refused: ApiError(400) naming the id in
      the API's words (`_ORPHAN`), as the hosted APIs refuse it, instead of a result the
      policy would read as an orphan turn.
    - A run of consecutive `tool` messages right after an assistant message with tool
      calls is ordered as those calls are (stable; results of other calls after them):
      the Qwen3 format renders results without their ids, in order, so the policy reads
      the k-th result as its k-th call's. Other messages keep their place.
    Returns `messages` itself when nothing moves (the message objects are never copied)."""
    seen: set[str] = set()
    out: list[dict] | None = None
    i = 0
    while i < len(messages):
        m = messages[i]
        if m.get("role") == "assistant":
            order = {}
            for call in m.get("tool_calls") or ():
                if isinstance(call, dict) and isinstance(call.get("id"), str) and call["id"]:
                    order.setdefault(call["id"], len(order))
            seen.update(order)
            j = i + 1
            while j < len(messages) and messages[j].get("role") == "tool":
                _check_result(messages[j], j, seen, api)
                j += 1
            run = messages[i + 1:j]
            ranked = sorted(run, key=lambda r: order.get(r.get("tool_call_id"), len(order)))
            if any(a is not b for a, b in zip(ranked, run)):
                out = list(messages) if out is None else out
                out[i + 1:j] = ranked
            i = j
            continue
        if m.get("role") == "tool":
            _check_result(m, i, seen, api)
        i += 1
    return messages if out is None else out


def _check_result(message: dict, index: int, seen: set[str], api: str) -> None:
    tc_id = message.get("tool_call_id")
    if isinstance(tc_id, str) and tc_id in seen:
        return
    text, param = _ORPHAN[api]
    if api == "chat":
        param = f"messages[{index}].tool_call_id"
    what = {"chat": "'tool_call_id'", "responses": "'call_id'", "messages": "`tool_use_id`"}[api]
    if not isinstance(tc_id, str):
        raise ApiError(400, f"a tool result's {what} must be a string naming the call it answers, got {tc_id!r}"[:300],
                       param=param)
    if not tc_id:
        raise ApiError(400, f"a tool result's {what} is empty: it must name the call it answers", param=param)
    raise ApiError(400, text.format(id=tc_id[:200]), param=param)


# --------------------------------------------------------------------------- helpers


def function_tool(tool: dict, parameters: dict) -> dict:
    """A tool in the chat form the renderer takes, from a client tool with a string `name`
    and an optional string `description`."""
    fn: dict[str, Any] = {"name": tool["name"]}
    if isinstance(tool.get("description"), str):
        fn["description"] = tool["description"]
    fn["parameters"] = parameters
    return {"type": "function", "function": fn}


def custom_tool(name: str, description: Any, fmt: Any) -> dict:
    """A custom tool (OpenAI's free-form-input tools: Chat `{"type": "custom", "custom":
    {name, description, format}}`, Responses `{"type": "custom", name, description,
    format}`) in the chat form the renderer takes: a function of one string parameter
    `input`, whose description names the input's grammar when `format` gives one
    (`{"type": "grammar", "syntax": "lark" | "regex", "definition"}`, nested under
    `grammar` in Chat). The policy's call `{"input": …}` is answered as the API's custom
    tool call (`gyre.serving.chat.custom_input`), and sent back it renders the same
    (`gyre.serving.chat.custom_arguments`)."""
    note = "The tool's free-form input."
    if isinstance(fmt, dict) and fmt.get("type") == "grammar":
        grammar = fmt.get("grammar") if isinstance(fmt.get("grammar"), dict) else fmt
        if isinstance(grammar.get("definition"), str):
            syntax = grammar.get("syntax") if isinstance(grammar.get("syntax"), str) else "lark"
            note = f"The tool's free-form input, which must match this {syntax} grammar:\n{grammar['definition']}"
    return function_tool({"name": name, "description": description},
                         {"type": "object", "properties": {"input": {"type": "string", "description": note}},
                          "required": ["input"]})


def sse(obj: Any, event: str | None = None) -> bytes:
    """One SSE frame: `event: NAME` (when given) and `data: JSON`."""
    head = b"event: " + event.encode() + b"\n" if event else b""
    return head + b"data: " + orjson.dumps(obj) + b"\n\n"


def pieces(text: str, size: int = 32) -> list[str]:
    """`text` cut into fragments of at most `size` characters (none for "")."""
    return [text[i:i + size] for i in range(0, len(text), size)]


def number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    """A numeric field in [lo, hi]; `default` when absent or null. Raises ApiError(400)."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(400, f"'{name}' must be a number, got {value!r}", param=name)
    if value < lo or value > hi:
        raise ApiError(400, f"'{name}' must be in [{lo}, {hi}], got {value}", param=name)
    return float(value)


def flag(body: dict, name: str) -> bool:
    """A boolean field; False when absent or null. Raises ApiError(400) for anything else
    (a string "false" must not turn a JSON answer into a stream)."""
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"'{name}' must be a boolean, got {value!r}"[:200], param=name)
    return value


class MessageMemo:
    """One execution's memo of per-message conversions (an API's message → internal
    messages), so a request that resends its history converts only what is new.

    Holds the latest `size` requests' raw messages (parsed JSON) and what each converted
    to; `convert` reuses the conversions of the longest common prefix with one of them
    (compared as parsed JSON, in C) and converts the rest. Exact for conversions that
    depend on the message alone (and its index, used only in error messages). The raw
    messages must not be mutated once passed in.
    """

    def __init__(self, size: int = 4):
        self.size = size
        self._seen: list[tuple[list, list[list[dict]]]] = []

    def convert(self, raw: list, one: Callable[[int, Any], list[dict]], remember: bool = True) -> list[dict]:
        """Internal messages of `raw`, `one(i, raw[i])` converting message i; `raw` becomes
        the newest request remembered unless `remember` is False. Raises what `one` raises
        (the memo is then left as it was)."""
        best, n = -1, 0
        for j, (old, _) in enumerate(self._seen):
            if min(len(raw), len(old)) <= n:
                continue  # cannot share more than the best so far: skip comparing it
            k = equal_prefix_len(raw, old, len(raw))  # clamps to both lengths
            if k > n:
                best, n = j, k
        if best >= 0:
            old, parts = self._seen[best]
            kept_raw, kept = old[:n], parts[:n]
        else:
            kept_raw, kept = [], []
        new = [one(i, raw[i]) for i in range(n, len(raw))]
        if not remember:
            return list(itertools.chain.from_iterable(kept + new))
        if best >= 0:
            del self._seen[best]
        kept_raw.extend(raw[n:])
        kept.extend(new)
        self._seen.insert(0, (kept_raw, kept))
        del self._seen[self.size:]
        return list(itertools.chain.from_iterable(kept))

    def reader(self) -> "MessageMemo":
        """This memo for a request that is converted and forgotten (a token count): its
        `convert` reuses what is remembered and remembers nothing."""
        return _MemoReader(self)  # type: ignore[return-value]


class _MemoReader:
    def __init__(self, memo: MessageMemo):
        self._memo = memo

    def convert(self, raw: list, one: Callable[[int, Any], list[dict]]) -> list[dict]:
        return self._memo.convert(raw, one, remember=False)


def parse_sampling(body: dict, defaults: SamplingParams, max_names: Iterable[str],
                   stop_name: str | None = None) -> SamplingParams:
    """Sampling from a request body. defaults: the proxy's temperature/top_p/top_k and the
    completion cap (`max_tokens`); the first present field of `max_names` is capped by it.
    stop_name: the API's stop-strings field (`stop`, `stop_sequences`), None when it has
    none. `top_p: 0` is sampled, and recorded, as `top_k = 1, top_p = 1` (the same
    distribution). Raises ApiError(400) on a malformed value."""
    cap = defaults.max_tokens
    max_tokens = cap
    for name in max_names:
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ApiError(400, f"'{name}' must be a positive integer, got {value!r}", param=name)
        max_tokens = min(value, cap)
        break
    top_k = body.get("top_k")
    if top_k is None:
        top_k = defaults.top_k
    elif isinstance(top_k, bool) or not isinstance(top_k, int) or top_k == 0 or top_k < -1:
        raise ApiError(400, f"'top_k' must be -1 or a positive integer, got {top_k!r}", param="top_k")
    stop: tuple[str, ...] = ()
    if stop_name is not None:
        try:
            stop = parse_stop(body.get(stop_name), stop_name)
        except ValueError as exc:
            raise ApiError(400, str(exc), param=stop_name) from None
    top_p = number(body, "top_p", defaults.top_p, 0.0, 1.0)
    if top_p == 0.0:  # the hosted APIs take [0, 1]; a nucleus of mass 0 is the top token alone,
        top_p, top_k = 1.0, 1  # and the engine (like SGLang) takes top_p only in (0, 1]
    return SamplingParams(
        temperature=number(body, "temperature", defaults.temperature, 0.0, 2.0),
        top_p=top_p,
        top_k=top_k,
        max_tokens=max_tokens,
        stop=stop,
    )


# --------------------------------------------------------------------------- request bodies


def zstd_decompressor() -> Any:
    """A zstd decompressor object (`decompress(data, max_length)`), None when no module."""
    try:
        from compression.zstd import ZstdDecompressor  # Python ≥ 3.14
    except ImportError:
        try:
            from backports.zstd import ZstdDecompressor
        except ImportError:
            return None
    return ZstdDecompressor()


def decode_body(raw: bytes, encoding: str, limit: int) -> bytes:
    """Undo a request's `Content-Encoding` (a comma-separated list, applied in order, so
    undone last to first). gzip and deflate always, zstd with `compression.zstd` /
    `backports.zstd` when installed; not br (no brotli binding bounds its output across
    versions, and no harness compresses its requests so). The decoded size is bounded by
    `limit` bytes (a small compressed body cannot expand without bound).
    Raises ApiError 415 (unsupported encoding), 413 (decoded body over limit), 400 (corrupt or
    cut short).
    """
    for coding in reversed([c.strip().lower() for c in encoding.split(",") if c.strip()]):
        if coding == "identity":
            continue
        if coding not in ("gzip", "x-gzip", "deflate", "zstd"):
            raise ApiError(415, f"unsupported Content-Encoding {coding!r}", code="unsupported_encoding")
        raw = _decoded(raw, coding, limit)
    return raw


MEMBERS = 64
"""Most members (gzip) or frames (zstd) one compressed request body may hold (clients send one)."""

_FEED = 1 << 20
"""Compressed bytes given a decompressor at once: at a member's end it copies what it was
given beyond it (`unused_data`), so a body of many members costs O(body), not O(body²)."""

_NULS = re.compile(rb"\x00*")


def _decoded(raw: bytes, coding: str, limit: int) -> bytes:
    """`raw` decoded by one of `decode_body`'s codings. gzip and zstd bodies may hold several
    members (frames) one after another, decoded as their concatenation (RFC 1952 2.2, RFC
    8878 3.1), at most `MEMBERS`; NUL bytes after a gzip member are padding, skipped as
    Python's `gzip.decompress` and GNU gzip skip them. Anything else after the stream is a
    400, as `gzip.decompress` refuses it. Linear in `len(raw)` (`_FEED`)."""
    if coding == "zstd" and zstd_decompressor() is None:
        raise ApiError(415, "Content-Encoding zstd is not supported here (no zstd module); "
                            "send gzip, deflate or identity", code="unsupported_encoding")
    view = memoryview(raw)
    parts: list[bytes] = []
    size = pos = 0
    for member in range(MEMBERS):
        # wbits 47: zlib or gzip header detected (raw deflate retried with -15); a further
        # gzip member: gzip only (31).
        d = zstd_decompressor() if coding == "zstd" else zlib.decompressobj(31 if member else 47)
        try:
            while not d.eof and pos < len(raw):
                chunk = view[pos:pos + _FEED]
                try:
                    out = d.decompress(chunk, limit + 1 - size)
                except zlib.error:
                    if coding != "deflate" or pos:  # raw deflate shows at the body's first bytes only
                        raise
                    d = zlib.decompressobj(-15)
                    out = d.decompress(chunk, limit + 1 - size)
                size += len(out)
                if size > limit:
                    raise ApiError(413, f"request body too large once decoded (> {limit} bytes)",
                                   code="request_too_large")
                parts.append(out)
                pos += len(chunk) - len(d.unused_data) if d.eof else len(chunk)
        except ApiError:
            raise
        except Exception as exc:  # noqa: BLE001 - every codec has its own error class
            what = f" (its member {member + 1})" if member else ""
            raise ApiError(400, f"the request body is not valid {coding}{what}: {exc}") from None
        if not d.eof:  # cut short: its checksum and length never arrived
            raise ApiError(400, f"the request body is not valid {coding}: it ends before the compressed stream does")
        if coding in ("gzip", "x-gzip"):
            pos = _NULS.match(raw, pos).end()
        if pos >= len(raw):
            return b"".join(parts)
        if coding == "deflate":
            raise ApiError(400, "the request body is not valid deflate: bytes follow the compressed stream")
    raise ApiError(400, f"the request body holds more than {MEMBERS} {coding} members; send one")
