"""Token-in, token-out (TITO): per-execution call store, normalisation, prefix matching.

DESIGN.md "Token-in, token-out". The trainer never re-tokenises text: for every call the
proxy keeps the exact ids the engine saw and sampled, and a new request reuses them
wherever it extends an earlier call.

Contract:
- `normalise(messages, tool_args)` maps harness noise onto one canonical form: a list of
  text parts becomes one string, `None` content becomes "", `cache_control` markers and
  unknown keys are dropped, and each tool call's arguments are restored from `tool_args`
  (tool-call id → the raw argument payload we emitted) when they parse to the same JSON
  (or are `{"input": payload}`: a custom tool call answered with the whole payload as
  its input), so a harness that re-serialises arguments (spacing, key order, \\u
  escapes) still matches. Messages are compared by `message_key`, which holds tool-call arguments as
  parsed JSON and ignores `reasoning_content` (harnesses drop or keep it at will).
- `CallStore.match(messages, tools) -> Match`:
  1. *Extension.* Find the recorded call c (same tools; the system prompt is a message)
     whose `c.messages + [c.answer]` is the longest message-level prefix of the request.
     The matched messages are replaced by c's recorded ones; c's conversation rendered
     without a generation prompt, cut right after its last `<|im_end|>`, must be a string
     prefix of the request's rendering. Then
     `prompt_ids = c.full_ids (+ <|im_end|> unless c's completion ended with it) + encode(suffix)`,
     the suffix starting with "\\n<|im_start|>". parent = c, prefix_len = len(c.full_ids).
     With gyre's template (`gyre.serving.chat.uses_gyre_template`) only the new messages are
     rendered (`gyre.serving.chat.render_appended`) and the prefix relation is decided from two
     facts kept per call (does the conversation hold a real user query; does an assistant
     after the last one show reasoning), so the cost does not grow with the history; with
     another template both conversations are rendered in full and compared.
  2. *Branch.* Otherwise (no such call, or the rendered text is not an extension, e.g. a
     template that drops earlier thinking) the whole request is rendered and encoded, and
     the recorded call sharing the longest common token prefix with it becomes the parent
     (prefix_len = that length; parent None and 0 when nothing is shared). Never raises
     for a mismatch.
  `match` = `attach` then `complete`. `attach` returns a gyre-template extension as its
  Match, and as a `Pending` any request whose prompt needs whole conversations rendered (a
  branch, a fresh request, with another template an extension candidate: `extends`) and a
  gyre-template extension by more than `HEAVY_CHARS` of new messages.
  A caller on an event loop can run `prepare(pending)` — the rendering and encoding, which
  read no store state calls change — in a worker thread between the two (the proxy does for
  `Pending.heavy` requests: a 600k-token branch is ≈ 0.2–0.3 s of work).
  Messages are normalised and hashed incrementally: a request is compared (as parsed
  JSON, in C) with the few latest requests of the execution, and only the messages after
  the common part are normalised and hashed again.
- `CallStore.fresh(messages, tools) -> Match`: the request rendered alone, parent None
  (auxiliary calls: counted, answered and published, never recorded). A token count is
  attached as its call would be (`attach(..., remember=False)`: the same prompt ids, the
  memo of latest requests left as it was) and never recorded either.
- A branch or fresh request's first turn (the system prompt and tool definitions, up to
  and including the first `<|im_end|>`) is encoded once per store: the latest
  `FIRST_TURNS` distinct ones used are kept with their ids. Branches (a compaction, the main
  line after it, a second sub-agent of a kind) and count_tokens calls resend them, and
  Claude Code's are ~17k tokens, 4 ms of encoding on the event loop on the 2-core CI
  machine. They name the execution's working directory, so stores do not share them.
  Exact because encoding splits at `<|im_end|>` (see Drift below).
- `CallStore.record(match, call=, seq=, answer=, completion_ids=)` adds a served call; its
  answer's tool-call payloads enter `tool_args`. Only calls whose answer reached the harness
  should be recorded.

Drift (the `drift` of `call.completed`): for an extension, the number of prompt positions
*outside the model-sampled completion spans* where the reused ids disagree with a fresh
`encode(render(request))`. Both sequences are aligned message by message (split after
every `<|im_end|>`), so a sampled span that re-tokenises to a different length shifts
nothing after it. Within a message chunk that holds sampled positions only the positions
before the first sampled one are compared (the template part `<|im_start|>assistant\\n`);
a chunk without sampled positions is compared in full, a length difference counting as
disagreement; an unpaired chunk counts all its unsampled positions. The template id just
before a sampled span does not count where the fresh tokenisation joined it with the span's
start (the header's "\n" and a completion opening with "\n" encode as one "\n\n" id): that
id holds sampled text. It is 0 for a BPE-stable template (every template boundary is a
special token, or a join of that kind). A branch is a fresh
tokenisation, so its drift is 0.
Counted incrementally with gyre's template: every rendered message starts right after a
`<|im_end|>`, a special token, and the tokenizer splits special tokens out before BPE, so
`encode(a + b) == encode(a) + encode(b)` whenever `a` ends with `<|im_end|>`. The request's
rendering is c's conversation cut after its last `<|im_end|>` followed by the suffix, and
its encoding splits the same way: the suffix region agrees by construction, and the
prefix chunks are c's prompt chunks (counted when c was matched: `c.drift`) plus c's last
turn — the generation prompt and c's completion (+ the closing `<|im_end|>`) against
`encode(render_assistant_turn(c.answer))`, counted once when c is recorded (after its
answer was delivered: `CallRecord.turn_drift`; when that turn is one chunk and its body
opens with an added token such as `<tool_call>` or `<think>`, only the ids before the
first sampled one count, and only the header up to that token is encoded). So
`drift = c.drift + that turn's count`, O(one turn). It equals the full-request count
(`CallStore.full_drift`, kept as the reference) except where a sampled span
re-tokenises to a different number of `<|im_end|>` chunks (the model wrote "<|im_end|>"
as plain text, or sampled `<|im_end|>` mid-completion): the full count then compares
every later message against the wrong one, the incremental one stays
inside that message. `check_drift=False` skips the count (drift 0).
Memory: a call stores only the ids after its prefix (`own_ids`, int32) and a reference to
its parent, so an execution of N calls over L tokens keeps O(L) ids, not O(N·L). The
normalisation memo holds the latest `MEMO_REQUESTS` requests' messages, sharing the
message objects they have in common.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import orjson

from gyre.serving.chat import (
    call_function, is_query, render_appended, render_assistant_turn, shows_reasoning, uses_gyre_template,
)
from gyre.serving.tokenizer import IM_END, IM_END_TEXT, fast_encoder

TURN_HEADER = "\n<|im_start|>assistant\n"
"""What an assistant turn opens with in gyre's template, after the previous `<|im_end|>`."""

FIRST_TURNS = 4
"""Distinct first turns (system prompt + tools) kept per execution with their ids: the
main agent's, before and after a compaction, and sub-agents' and side calls' own."""

MEMO_REQUESTS = 4
"""Latest requests per execution whose normalised messages are reused (main line,
sub-agents and side calls interleave)."""

TIP_CACHE = 8
"""Latest calls per execution whose full ids are also kept whole, as their prompt and
completion int32 arrays, so extending one costs one copy in C, not a walk over the call
chain. Arrays, not lists of
Python ints: a list of 10^4 ints is a container the cyclic GC walks item by item on
every collection while it lives (`gyre bench proxy` measured 15-80 ms pauses)."""

HEAVY_CHARS = 100_000
"""Characters (≈ 25k tokens, ≈ 6 ms of tiktoken on the 2-core CI machine) above which a
`Pending` request is `heavy` and the proxy renders and encodes it in a worker thread
(`CallStore.prepare`), off the event loop: a request whose prompt needs whole
conversations rendered (a branch, a fresh request, and every extension when the store is
not incremental) counting its messages and tools, or an incremental extension counting its
new messages (a huge tool output). A 600k-token conversation, 2.6 MB of text, takes 25–40
ms to render and 130–300 ms to encode."""

Renderer = Callable[..., str]
_IM_END_IDS = np.array([IM_END], np.int32)


# --------------------------------------------------------------------------- normalisation


def _strip_cache_control(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_cache_control(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [_strip_cache_control(v) for v in value]
    return value


def _content(content: Any) -> Any:
    """Canonical content: a string, or a list of parts when any part is not text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type") in ("text", "input_text", "output_text") \
                    and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                return _strip_cache_control(content)
        return "".join(texts)
    return _strip_cache_control(content)


def _parse_json(text: str) -> Any:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return _Unparsed(text)


@dataclasses.dataclass(frozen=True, slots=True)
class _Unparsed:
    """Arguments that are not JSON: compared as the raw string."""

    text: str


def _args_text(arguments: Any) -> str:
    if isinstance(arguments, str):
        return arguments if arguments.strip() else "{}"  # as gyre.serving.chat renders a call without arguments
    return orjson.dumps(arguments).decode()


def _tool_call(tc: dict, tool_args: dict[str, str]) -> dict:
    fn = call_function(tc) or {}
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):  # as gyre.serving.chat renders it: a call must name its function
        raise ValueError("a tool call's function name must be a string")
    args = _args_text(fn.get("arguments", ""))  # fn is a dict: it had a name
    tc_id = tc.get("id")
    if not isinstance(tc_id, (str, type(None))):  # it keys the raw-arguments cache
        raise ValueError(f"a tool call's id must be a string, got {type(tc_id).__name__}")
    tc_id = tc_id or ""
    raw = tool_args.get(tc_id) if tc_id else None
    if raw is not None and raw != args:
        sent = _parse_json(args)
        # the same JSON re-serialised; or a custom tool call answered with the policy's whole
        # arguments text as its input (`gyre.serving.chat.custom_input`) and sent back as {"input": …}
        if sent == _parse_json(raw) or (isinstance(sent, dict) and len(sent) == 1 and sent.get("input") == raw):
            args = raw
    return {"id": tc_id, "type": "function", "function": {"name": name, "arguments": args}}


def normalise_message(message: dict, tool_args: dict[str, str] | None = None) -> dict:
    """One message in canonical form (see module docstring). Raises ValueError when it
    is not an object with a string `role`."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ValueError(f"a message must be an object with a string 'role', got {str(message)[:80]!r}")
    tool_args = tool_args or {}
    out: dict[str, Any] = {"role": message["role"], "content": _content(message.get("content"))}
    calls = message.get("tool_calls")
    if calls:
        if not isinstance(calls, list) or not all(isinstance(tc, dict) for tc in calls):
            raise ValueError("'tool_calls' must be a list of objects")
        out["tool_calls"] = [_tool_call(tc, tool_args) for tc in calls]
    for key in ("tool_call_id", "name"):
        if isinstance(message.get(key), str) and message[key]:
            out[key] = message[key]
        elif message.get(key) is not None and not isinstance(message[key], str):
            raise ValueError(f"a message's {key!r} must be a string, got {type(message[key]).__name__}")
    reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning:
        out["reasoning_content"] = reasoning
    return out


def normalise(messages: Iterable[dict], tool_args: dict[str, str] | None = None) -> list[dict]:
    """Canonical form of a request's messages. Raises ValueError on a malformed message."""
    return [normalise_message(m, tool_args) for m in messages]


def _unmarked(d: dict) -> dict:
    return {k: v for k, v in d.items() if k != "cache_control"} if "cache_control" in d else d


def normalise_tools(tools: Any) -> list[dict]:
    """Tools without their `cache_control` markers (on a tool, or on a chat tool's
    `function`); a schema's own property of that name is the tool's and stays. None and []
    are the same (no tools). Key order is kept: the template writes each tool as JSON in
    the order given."""
    if not tools:
        return []
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ValueError("'tools' must be a list of objects")
    out = []
    for tool in tools:
        tool = _unmarked(tool)
        fn = tool.get("function")
        if isinstance(fn, dict) and "cache_control" in fn:
            tool = {**tool, "function": _unmarked(fn)}
        out.append(tool)
    return out


def _tools_json(tools: Any) -> bytes | None:
    """A request's tools as JSON, as sent (key order and number types kept: `1`, `1.0` and
    `true` render differently, though Python holds them equal); None when orjson cannot
    write them (nested past its 255 levels), which matches no earlier request."""
    try:
        return orjson.dumps(tools)
    except orjson.JSONEncodeError:
        return None


def _key_default(value: Any) -> Any:
    if isinstance(value, _Unparsed):
        return {"__unparsed__": value.text}
    raise TypeError


def message_key(message: dict) -> bytes:
    """Comparison key of a normalised message: tool-call arguments as parsed JSON (as
    their text when they nest deeper than orjson writes), `reasoning_content` ignored.
    Equal keys ⇔ the same message for TITO."""
    key: dict[str, Any] = {k: v for k, v in message.items() if k not in ("reasoning_content", "tool_calls")}
    if message.get("tool_calls"):
        key["tool_calls"] = [
            {"id": tc["id"], "name": tc["function"]["name"], "arguments": _parse_json(tc["function"]["arguments"])}
            for tc in message["tool_calls"]
        ]
    try:
        return orjson.dumps(key, option=orjson.OPT_SORT_KEYS, default=_key_default)
    except orjson.JSONEncodeError:  # arguments nested deeper than orjson writes (255 levels): compared as text
        for tc, raw in zip(key["tool_calls"], message["tool_calls"]):
            tc["arguments"] = _Unparsed(raw["function"]["arguments"])
        return orjson.dumps(key, option=orjson.OPT_SORT_KEYS, default=_key_default)


def equal_prefix_len(a: Sequence, b: Sequence, limit: int) -> int:
    """Length of the longest common prefix of a[:limit] and b[:limit] (items compared with
    `is` / `==`). The usual case, a resent history equal up to `limit`, is one list
    comparison in C."""
    limit = min(limit, len(a), len(b))
    if a[:limit] == b[:limit]:
        return limit
    k = 0
    while k < limit and (a[k] is b[k] or a[k] == b[k]):
        k += 1
    return k


def _chain(seed: bytes, keys: Iterable[bytes]) -> list[bytes]:
    """Cumulative digests: out[k] names (seed, keys[:k])."""
    out = [hashlib.sha256(b"tools\0" + seed).digest()]
    for key in keys:
        out.append(hashlib.sha256(out[-1] + key).digest())
    return out


# --------------------------------------------------------------------------- records


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class CallRecord:
    """One served call of an execution.

    call: call id. seq: order in the execution. parent/prefix_len: this call's full ids
    are `parent.full_ids()[:prefix_len] + own_ids` (parent None ⇒ prefix_len 0).
    own_ids: (N,) int32, the new prompt ids after the prefix followed by the completion.
    completion_len: C, the trailing ids of own_ids the model sampled (stop token included).
    messages: normalised request messages (shared with the parent's where reused).
    tools: normalised tools. answer: the assistant message returned to the harness
    (normalised; tool-call arguments are the raw payload the model emitted).
    drift: the drift of this call's prompt (module docstring). conv_query / conv_shown:
    facts of `messages + [answer]` in gyre's template (a real user query is present; an
    assistant after the last one shows reasoning). turn_start: index in `full_ids()` of
    the last prompt turn (right after the prompt's last `<|im_end|>`). turn_drift: that
    turn's drift as every extension of this call reuses it, against
    `encode(render_assistant_turn(answer))` (`CallStore._turn_drift`; 0 when drift is not
    counted or the template is not gyre's).
    """

    call: str
    seq: int
    parent: CallRecord | None
    prefix_len: int
    own_ids: np.ndarray
    completion_len: int
    messages: tuple[dict, ...]
    tools: tuple[dict, ...]
    answer: dict
    conv_key: bytes
    drift: int = 0
    conv_query: bool = False
    conv_shown: bool = False
    turn_start: int = 0
    turn_drift: int = 0

    @property
    def full_len(self) -> int:
        return self.prefix_len + len(self.own_ids)

    @property
    def prompt_len(self) -> int:
        return self.full_len - self.completion_len

    @property
    def stopped(self) -> bool:
        """True when the completion ended with `<|im_end|>` (the template's turn end)."""
        return self.completion_len > 0 and int(self.own_ids[-1]) == IM_END

    def segments(self, limit: int | None = None) -> list[np.ndarray]:
        """Views whose concatenation is `full_ids()[:limit]`, root first."""
        limit = self.full_len if limit is None else min(limit, self.full_len)
        out: list[np.ndarray] = []
        rec: CallRecord | None = self
        while rec is not None and limit > 0:
            if limit > rec.prefix_len:
                out.append(rec.own_ids[: limit - rec.prefix_len])
                limit = rec.prefix_len
            rec = rec.parent
        out.reverse()
        return out

    def full_ids(self) -> np.ndarray:
        """(L,) int32: prompt ids + completion ids."""
        segs = self.segments()
        return np.concatenate(segs) if segs else np.zeros(0, np.int32)

    def sampled_range(self, start: int, end: int) -> np.ndarray:
        """(end - start,) bool: `sampled_mask(end)[start:]`, walking only the calls whose
        completions can reach past `start`."""
        mask = np.zeros(end - start, bool)
        limit = min(end, self.full_len)
        rec: CallRecord | None = self
        while rec is not None and limit > start:
            lo = max(rec.full_len - rec.completion_len, start)
            hi = min(limit, rec.full_len)
            if lo < hi:
                mask[lo - start:hi - start] = True
            limit = min(limit, rec.prefix_len)
            rec = rec.parent
        return mask

    def sampled_mask(self, length: int) -> np.ndarray:
        """(length,) bool: positions of `full_ids()[:length]` sampled by the model (in
        this call or an ancestor whose ids it reuses)."""
        mask = np.zeros(length, bool)
        limit = min(length, self.full_len)
        rec: CallRecord | None = self
        while rec is not None and limit > 0:
            start = rec.full_len - rec.completion_len
            if start < limit:
                mask[start:min(limit, rec.full_len)] = True
            limit = min(limit, rec.prefix_len)
            rec = rec.parent
        return mask


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Match:
    """Where a request attaches to the execution's calls.

    parent: the call whose full ids the prompt starts with (None for a root).
    prefix_len: leading ids of parent's full ids reused verbatim (0 for a root).
    prompt_ids: (P,) int32, the whole prompt to send to the engine.
    extended: True for a message-level extension (ids reused), False for a branch/root.
    drift: see module docstring. messages/tools: what was rendered (normalised).
    digest: names (tools, messages) for message-level matching. query / shown: facts of
    `messages` in gyre's template (see CallRecord.conv_query / conv_shown).
    """

    parent: CallRecord | None
    prefix_len: int
    prompt_ids: np.ndarray
    extended: bool
    drift: int
    messages: tuple[dict, ...]
    tools: tuple[dict, ...]
    digest: bytes
    query: bool = False
    shown: bool = False

    @property
    def new_prompt_ids(self) -> np.ndarray:
        """(P - prefix_len,) int32: the prompt ids after the reused prefix."""
        return self.prompt_ids[self.prefix_len:]


@dataclasses.dataclass(frozen=True, slots=True)
class Pending:
    """A request whose prompt `CallStore.attach` leaves to `CallStore.prepare` (rendering
    and encoding, safe in a worker thread) and `CallStore.complete` (attaching): a branch
    or fresh request; in a store that is not incremental (another template than gyre's, or
    a `render` given) any request that may extend the call `extends`; in an incremental
    store an extension of `extends` by heavy new messages.

    messages / tools: normalised, as Match. digest: as Match.digest (b"" when fresh).
    fresh: attach to nothing (auxiliary calls; `CallStore.fresh`). heavy: more than
    `HEAVY_CHARS` characters of text (content and its text parts, reasoning, tool-call
    arguments; and the tools' JSON unless it extends an incremental store's call, where
    only the new messages count). extends: the recorded call whose conversation + answer
    are the request's first messages (None for a branch); rest: the messages after them.
    """

    messages: tuple[dict, ...]
    tools: tuple[dict, ...]
    digest: bytes
    fresh: bool
    heavy: bool
    extends: CallRecord | None = None
    rest: tuple[dict, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class Prepared:
    """What `CallStore.prepare` made of a `Pending` request (int32 arrays, may be read-only):
    `prompt_ids` (P,), the whole prompt of a branch or fresh request; or, for an extension,
    `suffix_ids` (S,), the ids after `extends`' conversation, and `reference_ids` (R,), the
    whole request encoded afresh (drift; None when drift is not counted)."""

    prompt_ids: np.ndarray | None = None
    suffix_ids: np.ndarray | None = None
    reference_ids: np.ndarray | None = None


MESSAGE_CHARS = 100
"""What `_text_chars` counts for each message and tool call besides its text: the template's
framing (`<|im_start|>role\n`, `<tool_call>` with the name, `<tool_response>`…), ≈ 60–90
characters, and rendering's per-message cost (≈ 0.1 ms a message in Jinja here: 2,400
short turns rendered in 0.35 s)."""


def _text_chars(messages: Iterable[dict], tools: Sequence[dict]) -> int:
    """Characters in normalised messages' text (content and its text parts, reasoning,
    tool-call arguments) and in the tools' JSON, plus `MESSAGE_CHARS` per message and tool
    call. An estimate of the rendering's length."""
    n = len(orjson.dumps(list(tools))) if tools else 0
    for m in messages:
        n += MESSAGE_CHARS
        content = m["content"]
        if isinstance(content, str):
            n += len(content)
        elif isinstance(content, list):  # parts, not all typed text (`_content`): their text counts
            for part in content:
                if isinstance(part, str):
                    n += len(part)
                elif isinstance(part, dict) and isinstance(part.get("text"), str):
                    n += len(part["text"])
        n += len(m.get("reasoning_content", ""))
        for tc in m.get("tool_calls", ()):
            n += MESSAGE_CHARS + len(tc["function"]["arguments"])
    return n


# --------------------------------------------------------------------------- drift


def _chunks(ids: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) ranges split right after every <|im_end|>."""
    ends = (np.flatnonzero(ids == IM_END) + 1).tolist()
    if not ends or ends[-1] != len(ids):
        ends.append(len(ids))
    starts = [0, *ends[:-1]]
    return [(s, e) for s, e in zip(starts, ends) if e > s]


def count_drift(recorded: np.ndarray, sampled: np.ndarray, rendered: np.ndarray,
                joins: Callable[[int, int], bool] | None = None) -> int:
    """Prompt positions outside sampled spans where recorded and re-rendered ids disagree.

    recorded: (P,) int ids sent to the engine; sampled: (P,) bool, True where the model
    sampled the id; rendered: (R,) int, a fresh tokenisation of the rendered request.
    joins(r, f): True when id f's text is id r's text followed by more; with it, the
    template id just before a sampled span is not counted where the fresh tokenisation
    joined it with the span's first characters (a completion opening with "\n" after the
    header's "\n": one "\n\n" id), since that id then spans sampled text.
    Alignment and counting rules: module docstring ("Drift").
    """
    if len(recorded) == len(rendered) and np.array_equal(recorded, rendered):
        return 0  # the usual case: nothing disagrees, whatever was sampled
    rec_chunks, ren_chunks = _chunks(recorded), _chunks(rendered)
    drift = 0
    for i in range(max(len(rec_chunks), len(ren_chunks))):
        if i >= len(rec_chunks):
            s, e = ren_chunks[i]
            drift += e - s
            continue
        s, e = rec_chunks[i]
        mask = sampled[s:e]
        if i >= len(ren_chunks):
            drift += int((~mask).sum())
            continue
        a, b = recorded[s:e], rendered[ren_chunks[i][0]:ren_chunks[i][1]]
        hits = np.flatnonzero(mask)
        if len(hits):
            n = int(hits[0])
            m = min(n, len(b))
            drift += int((a[:m] != b[:m]).sum()) + (n - m)
            if joins is not None and 0 < n == m and a[n - 1] != b[n - 1] and joins(int(a[n - 1]), int(b[n - 1])):
                drift -= 1
        else:
            m = min(len(a), len(b))
            drift += int((a[:m] != b[:m]).sum()) + abs(len(a) - len(b))
    return drift


def _shared_len(rec: CallRecord, ids: np.ndarray, memo: dict[str, int]) -> int:
    """Length of the common prefix of `rec.full_ids()` and `ids` (P,), from its ancestors':
    rec's full ids are its parent's first `prefix_len` then `own_ids`, so only `own_ids` is
    compared, and only when the parent's share covers the prefix. memo: call → that length
    for the calls seen so far (filled here), so calls sharing ancestors compare them once:
    O(records + shared ids) for all the leaves of a tree, not O(leaves × prompt)."""
    chain: list[CallRecord] = []
    r: CallRecord | None = rec
    while r is not None and r.call not in memo:
        chain.append(r)
        r = r.parent
    n = memo[r.call] if r is not None else 0
    for c in reversed(chain):
        if n >= c.prefix_len:
            n = c.prefix_len
            m = min(len(c.own_ids), len(ids) - n)
            if m > 0:
                eq = c.own_ids[:m] == ids[n:n + m]
                n += m if eq.all() else int(np.argmin(eq))
        memo[c.call] = n
    return n


# --------------------------------------------------------------------------- store


def conversation_facts(messages: Sequence[dict], after: tuple[bool, bool] = (False, False)) -> tuple[bool, bool]:
    """(query, shown) of a conversation in gyre's template: does it hold a real user query
    (`gyre.serving.chat.is_query`), and does an assistant after the last one show reasoning
    (`gyre.serving.chat.shows_reasoning`). `after`: the facts of the conversation `messages`
    continue (default: an empty one), so the cost is O(len(messages)).
    Errors: `ValueError` for content the renderer rejects."""
    last = -1
    for i in range(len(messages) - 1, -1, -1):
        if is_query(messages[i]):
            last = i
            break
    if last >= 0:
        return True, any(shows_reasoning(m) for m in messages[last + 1:])
    query, shown = after
    return query, shown or (query and any(shows_reasoning(m) for m in messages))


@dataclasses.dataclass(slots=True)
class _Seen:
    """One recent request, normalised: raw messages as received (compared with the next
    requests), their normalised forms and the cumulative digests (`_chain`, len(raw) + 1).
    unknown: tool-call id → index of the first message that used it while `tool_args`
    lacked it (that message would normalise differently once the id is known)."""

    tools_json: bytes | None  # `_tools_json` of the request's tools as received
    tools: tuple[dict, ...]
    raw: list
    norm: list[dict]
    digests: list[bytes]
    unknown: dict[str, int]


class CallStore:
    """The calls of one execution and the raw tool-call payloads we emitted.

    tokenizer: an HF tokenizer (`gyre.serving.tokenizer.build_tokenizer()` or the model's).
    render: `gyre.serving.chat.render(tokenizer, messages, tools, add_generation_prompt)`; None =
      that function, with incremental rendering when the tokenizer is on gyre's template.
    check_drift: count drift on extensions (module docstring; O(one turn) on gyre's
      template, O(prompt) re-tokenisation otherwise); False reports drift 0.
    Attributes: `incremental` (only new messages are rendered; module docstring).
    Not thread-safe; one event loop owns it. Only `prepare` and `encode` may run in another
    thread meanwhile (they read no state the others change).
    """

    def __init__(self, tokenizer: Any, *, render: Renderer | None = None, check_drift: bool = True):
        split = _special_tokens_split(tokenizer)
        self.incremental = render is None and uses_gyre_template(tokenizer) and split
        self._splitting = _splitting_tokens(tokenizer)
        # First turns are split off only where encoding splits at <|im_end|> wherever it is written.
        self._first_turns: dict[str, np.ndarray] | None = {} if split and _im_end_stands_alone(tokenizer, self._splitting) else None
        if render is None:
            from gyre.serving.chat import render as chat_render

            render = chat_render
        self.tokenizer = tokenizer
        self.render = render
        self.check_drift = check_drift
        self.calls: list[CallRecord] = []
        self.tool_args: dict[str, str] = {}
        self._by_conv: dict[bytes, CallRecord] = {}
        self._by_call: dict[str, CallRecord] = {}
        self._extended: set[str] = set()
        self._seen: list[_Seen] = []
        self._tips: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._opening = _opening_pattern(self._splitting)
        self._heads: dict[str, np.ndarray] = {}
        backend = getattr(tokenizer, "backend_tokenizer", None)
        split = getattr(tokenizer, "split_special_tokens", False)  # the backend would parse them
        # tiktoken on gyre's Qwen3 vocabulary; else the fast tokenizer's own encoder (same ids,
        # less overhead than __call__); else None.
        fast = fast_encoder(tokenizer)
        self._fast_array = fast.array if fast is not None else None
        self._fast_encode = fast or (
            (lambda text: backend.encode(text, add_special_tokens=False).ids) if backend is not None and not split
            else None)

    # -- helpers
    def _joins(self, recorded: int, fresh: int) -> bool:
        """Id `fresh`'s text is id `recorded`'s followed by more (`count_drift`'s `joins`),
        compared as the vocabulary writes them (byte-level BPE: one character a byte)."""
        a, b = self.tokenizer.convert_ids_to_tokens([recorded, fresh])
        return isinstance(a, str) and isinstance(b, str) and len(b) > len(a) and b.startswith(a)

    def encode_list(self, text: str) -> list[int]:
        """Ids of `text` as a list, no special tokens added (special-token text is parsed)."""
        if self._fast_encode is not None:  # same ids, several times faster (gyre.serving.tokenizer.fast_encoder)
            return self._fast_encode(text)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode(self, text: str) -> np.ndarray:
        """(N,) int32 ids of `text`, no special tokens added (special-token text is parsed).
        Thread-safe; may be read-only. With gyre's tokenizer tiktoken encodes with the GIL
        released (`gyre.serving.tokenizer.FastEncoder.array`)."""
        if self._fast_array is not None:
            return self._fast_array(text)
        return np.asarray(self.encode_list(text), dtype=np.int32)

    def encode_prompt(self, text: str) -> np.ndarray:
        """(N,) int32 ids of a whole rendered prompt: `encode(text)`, its first turn
        encoded once per store (the module docstring)."""
        kept = self._first_turns
        end = text.find(IM_END_TEXT) + len(IM_END_TEXT) if kept is not None else 0
        if end < len(IM_END_TEXT):
            return self.encode(text)
        head = text[:end]
        ids = kept.pop(head, None)
        if ids is None:
            if len(kept) >= FIRST_TURNS:
                del kept[next(iter(kept))]  # the least recently used
            ids = self.encode(head)
        kept[head] = ids  # the newest
        return np.concatenate((ids, self.encode(text[end:])))

    def _prompt(self, c: CallRecord, suffix: Sequence[int] | np.ndarray) -> np.ndarray:
        """The prompt extending c: c's full ids (+ <|im_end|> unless c stopped) + suffix.
        c's cached prompt and completion (`TIP_CACHE`) are used when present, so no walk over
        the call chain runs (c leaves the cache when its extension is recorded: `record`)."""
        parts = list(self._tips.get(c.call) or (c.full_ids(),))
        if not c.stopped:
            parts.append(_IM_END_IDS)
        parts.append(np.asarray(suffix, np.int32))
        return np.concatenate(parts)

    def _render(self, messages: Sequence[dict], tools: Sequence[dict], gen: bool) -> str:
        return self.render(self.tokenizer, list(messages), list(tools) or None, gen)

    def normalise(self, messages: Iterable[dict]) -> list[dict]:
        return normalise(messages, self.tool_args)

    def _normalised(self, messages: Sequence[dict], tools: Any,
                    remember: bool = True) -> tuple[list[dict], tuple[dict, ...], list[bytes]]:
        """(normalised messages, normalised tools, cumulative digests), reusing the latest
        requests' work for the messages they share with this one (module docstring); the
        request becomes the newest remembered one unless `remember` is False."""
        if not isinstance(messages, list):
            messages = list(messages)
        args = self.tool_args
        best: _Seen | None = None
        n = 0
        tools_json = _tools_json(tools)
        for seen in self._seen:
            if tools_json is None or seen.tools_json != tools_json:
                continue
            top = min(len(seen.raw), len(messages))
            if best is not None and top <= n:
                continue  # cannot share more than the best so far: skip comparing it
            for tc_id, index in seen.unknown.items():
                if index < top and tc_id in args:
                    top = index
            k = equal_prefix_len(messages, seen.raw, top)
            if best is None or k > n:
                best, n = seen, k
        if best is not None:
            tools_n, digests = best.tools, best.digests[: n + 1]
            raw, norm = best.raw[:n], best.norm[:n]
            unknown = {i: x for i, x in best.unknown.items() if x < n}
            if remember:
                self._seen.remove(best)
        else:
            tools_n = tuple(normalise_tools(tools))
            digests = _chain(orjson.dumps(list(tools_n)), ())  # in the order the template writes them
            raw, norm, unknown = [], [], {}
        for m in messages[n:]:
            nm = normalise_message(m, args)
            for tc in nm.get("tool_calls", ()):
                if tc["id"] and tc["id"] not in args:
                    unknown.setdefault(tc["id"], len(norm))
            raw.append(m)
            norm.append(nm)
            digests.append(hashlib.sha256(digests[-1] + message_key(nm)).digest())
        if remember:
            self._seen.insert(0, _Seen(tools_json=tools_json, tools=tools_n, raw=raw, norm=norm, digests=digests,
                                       unknown=unknown))
            del self._seen[MEMO_REQUESTS:]
        return list(norm), tools_n, digests

    # -- matching
    def match(self, messages: Sequence[dict], tools: Any = None) -> Match:
        """Attach a request to the recorded calls (module docstring): `attach`, then
        `complete` on the event loop's thread. Raises ValueError on malformed messages or
        tools, and whatever `render` raises on a request the template cannot render."""
        found = self.attach(messages, tools)
        return found if isinstance(found, Match) else self.complete(found)

    def fresh(self, messages: Sequence[dict], tools: Any = None) -> Match:
        """A request rendered and encoded on its own, attached to nothing (parent None):
        for auxiliary calls (titles, small-model side calls) that must not shape the
        trajectory tree. Raises like `match`."""
        return self.complete(self.attach(messages, tools, fresh=True))

    def attach(self, messages: Sequence[dict], tools: Any = None, *, fresh: bool = False,
               remember: bool = True) -> Match | Pending:
        """The extension `match` finds with gyre's template (only new messages rendered), or
        a `Pending` request: one whose prompt needs whole conversations rendered (a branch,
        any request when `fresh`, with another template every request that may extend a
        call), or a gyre-template extension by heavy new messages (`Pending`). Raises
        ValueError on malformed messages or tools, and whatever `render` raises while
        extending. remember=False (a token count: the request is attached as its call would
        be, and forgotten) leaves the normalisation memo's latest requests as they were."""
        if fresh:
            msgs = self.normalise(messages)
            tools_n = tuple(normalise_tools(tools))
            return Pending(messages=tuple(msgs), tools=tools_n, digest=b"", fresh=True,
                           heavy=_text_chars(msgs, tools_n) > HEAVY_CHARS)
        msgs, tools_n, digests = self._normalised(messages, tools, remember)
        extends: CallRecord | None = None
        k = 0
        for k in range(len(msgs), 0, -1):
            c = self._by_conv.get(digests[k])
            if c is None:
                continue
            if not self.incremental:
                extends = c  # decided once both conversations are rendered (`prepare`)
                break
            rest = msgs[k:]
            if _text_chars(rest, ()) > HEAVY_CHARS and not _drops_shown_reasoning(c, rest):
                # an extension by long messages (a huge tool output): only they are rendered, in `prepare`
                return Pending(messages=tuple(msgs), tools=tools_n, digest=digests[-1], fresh=False, heavy=True,
                               extends=c, rest=tuple(rest))
            found = self._extend_appended(c, rest, tools_n, digests[-1])
            if found is not None:
                return found
            break  # the longest message-level match is not a token-level extension
        return Pending(messages=tuple(msgs), tools=tools_n, digest=digests[-1], fresh=False,
                       heavy=_text_chars(msgs, tools_n) > HEAVY_CHARS, extends=extends,
                       rest=tuple(msgs[k:]) if extends is not None else ())

    def prepare(self, pending: Pending) -> Prepared:
        """Render and encode `pending`. An extension candidate (`pending.extends`, another
        template than gyre's) renders the call's conversation (its recorded messages and
        answer) with and without `pending.rest`: when the shorter, cut after its last
        `<|im_end|>`, is a string prefix of the longer, the rest is encoded (`suffix_ids`; and
        the whole request when drift is counted), else the request is a branch (`prompt_ids`,
        the request's own messages rendered). An incremental store's `extends` renders only
        `pending.rest`. Reads nothing of the store that calls change (the first-turn cache is
        not used), so it may run in a worker thread while the event loop uses the store.
        Raises whatever `render` raises."""
        return self._prepare(pending, self.encode)

    def _prepare(self, pending: Pending, encode_prompt: Callable[[str], np.ndarray]) -> Prepared:
        c = pending.extends
        if c is not None and self.incremental:  # attach decided it extends c: the new messages only
            return Prepared(suffix_ids=self.encode(render_appended(self.tokenizer, list(pending.rest),
                                                                   after_query=c.conv_query)))
        if c is not None:  # c's recorded messages, which may show what the request's omit (reasoning)
            conv = (*c.messages, c.answer)
            text = self._render((*conv, *pending.rest), pending.tools, True)
            prev = self._render(conv, pending.tools, False)
            cut = prev.rfind(IM_END_TEXT)
            if cut >= 0 and text.startswith(prev[: cut + len(IM_END_TEXT)]):
                return Prepared(suffix_ids=self.encode(text[cut + len(IM_END_TEXT):]),
                                reference_ids=self.encode(text) if self.check_drift else None)
        return Prepared(prompt_ids=encode_prompt(self._render(pending.messages, pending.tools, True)))

    def complete(self, pending: Pending, prepared: Prepared | None = None) -> Match:
        """`pending` attached: an extension of `pending.extends` (module docstring), a fresh
        root, or a branch whose parent is the recorded call sharing the longest token prefix
        with it. prepared: from `prepare(pending)`; None = made here, a branch's first turn
        from the store's cache. Raises whatever `render` raises."""
        if prepared is None:
            prepared = self._prepare(pending, self.encode_prompt)
        msgs, tools = pending.messages, pending.tools
        c = pending.extends
        if prepared.suffix_ids is not None and c is not None:  # an extension of c
            if self.incremental:
                return self._extend_appended(c, list(pending.rest), tools, pending.digest, prepared.suffix_ids)
            prompt = self._prompt(c, prepared.suffix_ids)
            drift = 0
            if prepared.reference_ids is not None:
                sampled = np.zeros(len(prompt), bool)
                sampled[: c.full_len] = c.sampled_mask(c.full_len)
                drift = count_drift(prompt, sampled, prepared.reference_ids, self._joins)
            return Match(parent=c, prefix_len=c.full_len, prompt_ids=prompt, extended=True, drift=drift,
                         messages=(*c.messages, c.answer, *pending.rest), tools=tools, digest=pending.digest)
        prompt_ids = prepared.prompt_ids
        if pending.fresh:
            return Match(parent=None, prefix_len=0, prompt_ids=prompt_ids, extended=False, drift=0,
                         messages=msgs, tools=tools, digest=b"")
        best: CallRecord | None = None
        best_len = 0
        shared: dict[str, int] = {}
        for rec in self.calls:
            if rec.call in self._extended:
                continue  # a child that extends it shares at least as long a prefix
            n = _shared_len(rec, prompt_ids, shared)
            if n > best_len or (n == best_len and best is not None and n > 0 and rec.seq > best.seq):
                best, best_len = rec, n
        # Attach at the call that first held the shared ids.
        while best is not None and best.parent is not None and best_len <= best.prefix_len:
            best = best.parent
        if best_len == 0:
            best = None
        query, shown = conversation_facts(msgs) if self.incremental else (False, False)
        return Match(parent=best, prefix_len=best_len, prompt_ids=prompt_ids, extended=False, drift=0,
                     messages=msgs, tools=tools, digest=pending.digest, query=query, shown=shown)

    def _extend_appended(self, c: CallRecord, rest: list[dict], tools: tuple[dict, ...], digest: bytes,
                         suffix: np.ndarray | None = None) -> Match | None:
        """Extension rendering only `rest` (gyre's template; module docstring). suffix: its
        ids when `prepare` made them (`attach` has then checked that it extends c)."""
        query, shown = conversation_facts(rest, (c.conv_query, c.conv_shown))
        if suffix is None:
            if _drops_shown_reasoning(c, rest):
                return None
            suffix = self.encode_list(render_appended(self.tokenizer, rest, after_query=c.conv_query))
        prompt = self._prompt(c, suffix)
        drift = c.drift + c.turn_drift if self.check_drift else 0
        return Match(parent=c, prefix_len=c.full_len, prompt_ids=prompt, extended=True, drift=drift,
                     messages=(*c.messages, c.answer, *rest), tools=tools, digest=digest, query=query, shown=shown)

    def _recorded_turn_drift(self, match: Match, turn_start: int, comp: np.ndarray, text: str) -> int:
        """`_turn_drift` of a call being recorded: its ids from `turn_start` (the last turn's
        start in `match.prompt_ids`) with the completion `comp` (+ <|im_end|> when it did not
        stop), against `text`, its turn as rendered.

        The usual case is counted without building the turn's arrays, as `_turn_drift`'s
        shortcut counts it: the turn's header ids all lie in the call's own prompt (none
        sampled), neither they nor the completion before its last id hold <|im_end|>, the
        completion ends with it, and `_turn_head` applies with the header no longer than the
        head: the header ids against the head's."""
        tail = match.prompt_ids[turn_start:]
        n = len(tail)
        head = self._turn_head(text)
        if head is not None and n <= len(head) and len(comp) and int(comp[-1]) == IM_END \
                and (match.parent is None or turn_start >= match.prefix_len) \
                and comp.tolist().count(IM_END) == 1 and IM_END not in tail.tolist():
            return int(np.count_nonzero(tail != head[:n]))
        ids = np.concatenate([tail, comp])
        sampled = np.zeros(len(ids), bool)
        sampled[n:] = True
        if match.parent is not None and turn_start < match.prefix_len:
            sampled[: match.prefix_len - turn_start] = match.parent.sampled_range(turn_start, match.prefix_len)
        if not (len(comp) and int(comp[-1]) == IM_END):
            ids = np.append(ids, np.int32(IM_END))
            sampled = np.append(sampled, False)
        return self._turn_drift(ids, sampled, text)

    def _turn_drift(self, ids: np.ndarray, sampled: np.ndarray, text: str) -> int:
        """Drift of a call's last turn as an extension reuses it: `ids` (T,) the stored ids
        from the prompt's last turn start to the end (+ the closing <|im_end|> when the
        completion did not stop), `sampled` (T,) bool, against `encode(text)`, the turn as
        rendered (module docstring).

        Shortcut, same count: when the turn is one chunk on both sides (a single
        <|im_end|>, at the end) and the rendered body opens with an added token, only the
        ids before the first sampled one are compared, and those lie in the encoding of the
        header up to that token (encoding splits at added tokens), so the body is not
        encoded. A model's answer usually opens so (`<think>`, `<tool_call>`)."""
        head = self._turn_head(text)
        if head is not None:
            hits = np.flatnonzero(sampled[: len(head) + 1])
            if len(hits) and int(hits[0]) <= len(head) and int(np.count_nonzero(ids == IM_END)) == 1 \
                    and int(ids[-1]) == IM_END:
                n = int(hits[0])
                return int(np.count_nonzero(ids[:n] != head[:n]))
        return count_drift(ids, sampled, self.encode(text), self._joins)

    def _turn_head(self, text: str) -> np.ndarray | None:
        """`encode(TURN_HEADER + token)` when `text` is TURN_HEADER + body + "<|im_end|>"
        with no other <|im_end|> and the body opens with exactly one of the added tokens
        the encoding splits at as written (`_splitting_tokens`); else None."""
        if not text.startswith(TURN_HEADER) or not text.endswith(IM_END_TEXT) or text.count(IM_END_TEXT) != 1:
            return None
        k = len(TURN_HEADER)
        if not self._splitting or not text.startswith(self._splitting, k):
            return None
        if self._opening is not None:  # no token is a prefix of another: the one that opens the body
            opening = self._opening.match(text, k).group()
        else:
            openings = [t for t in self._splitting if text.startswith(t, k)]
            if len(openings) != 1:
                return None
            opening = openings[0]
        head = self._heads.get(opening)
        if head is None:
            head = self._heads[opening] = self.encode(TURN_HEADER + opening)
        return head

    def full_drift(self, match: Match) -> int:
        """The drift of an extension counted on the whole request: `match.prompt_ids`
        against a fresh `encode(render(...))` of its messages, O(prompt) — the reference
        definition (module docstring), for tests and audits. 0 for a branch."""
        if not match.extended or match.parent is None:
            return 0
        sampled = np.zeros(len(match.prompt_ids), bool)
        sampled[: match.prefix_len] = match.parent.sampled_mask(match.prefix_len)
        return count_drift(match.prompt_ids, sampled, self.encode(self._render(match.messages, match.tools, True)),
                           self._joins)

    # -- recording
    def record(self, match: Match, *, call: str, seq: int, answer: dict,
               completion_ids: Sequence[int]) -> CallRecord:
        """Add a served call. answer: the assistant message returned to the harness, with
        tool-call `arguments` exactly as emitted; they are cached by tool-call id.
        completion_ids: (C,) sampled ids, stop token included when the engine stopped.
        With gyre's template and drift counted, the answer's turn is rendered here (after
        delivery) and its drift counted for the next extension (`_turn_drift`). The store keeps
        `match.prompt_ids` itself, not a copy: do not modify it afterwards."""
        answer_n = normalise_message(answer)
        for tc in answer_n.get("tool_calls", ()):
            if tc["id"]:
                self.tool_args[tc["id"]] = tc["function"]["arguments"]
        comp = np.asarray(completion_ids, dtype=np.int32)
        own = np.concatenate([match.new_prompt_ids, comp]).astype(np.int32, copy=False)
        conv_key = hashlib.sha256(match.digest + message_key(answer_n)).digest()
        prompt_len = len(match.prompt_ids)
        turn_start = turn_drift = 0
        conv_shown = match.shown
        if self.incremental:
            conv_shown = conv_shown or (match.query and shows_reasoning(answer_n))
            ends = np.flatnonzero(match.prompt_ids[match.prefix_len:] == IM_END)
            if len(ends):
                turn_start = match.prefix_len + int(ends[-1]) + 1
            elif match.parent is not None:
                turn_start = _last_im_end_before(match.parent, match.prefix_len) + 1
            turn_start = min(turn_start, prompt_len)
            if self.check_drift:
                text = render_assistant_turn(self.tokenizer, answer_n, after_query=match.query)
                turn_drift = self._recorded_turn_drift(match, turn_start, comp, text)
        rec = CallRecord(call=call, seq=seq, parent=match.parent, prefix_len=match.prefix_len, own_ids=own,
                         completion_len=len(comp), messages=match.messages, tools=match.tools,
                         answer=answer_n, conv_key=conv_key, drift=match.drift, conv_query=match.query,
                         conv_shown=conv_shown, turn_start=turn_start, turn_drift=turn_drift)
        self.calls.append(rec)
        self._by_conv[conv_key] = rec
        self._by_call[call] = rec
        if match.parent is not None and match.prefix_len == match.parent.full_len:
            self._tips.pop(match.parent.call, None)  # its extension holds the newest ids
        self._tips[call] = (match.prompt_ids, comp)
        while len(self._tips) > TIP_CACHE:
            del self._tips[next(iter(self._tips))]
        if match.parent is not None and match.prefix_len == match.parent.full_len:
            self._extended.add(match.parent.call)
        return rec

    def get(self, call: str) -> CallRecord | None:
        return self._by_call.get(call)


def _last_im_end_before(rec: CallRecord, limit: int) -> int:
    """Index of the last <|im_end|> in `rec.full_ids()[:limit]`, -1 when there is none."""
    r: CallRecord | None = rec
    limit = min(limit, rec.full_len)
    while r is not None and limit > 0:
        if limit > r.prefix_len:
            hits = np.flatnonzero(r.own_ids[: limit - r.prefix_len] == IM_END)
            if len(hits):
                return r.prefix_len + int(hits[-1])
            limit = r.prefix_len
        r = r.parent
    return -1


def _drops_shown_reasoning(c: CallRecord, rest: Sequence[dict]) -> bool:
    """With gyre's template: a real user query in `rest` after c's conversation showed
    reasoning, which the template then drops, so c's rendering is no prefix of the
    request's (a branch, not an extension)."""
    return c.conv_shown and any(is_query(m) for m in rest)


def _splitting_tokens(tokenizer: Any) -> tuple[str, ...]:
    """Texts of the tokenizer's added tokens that its encoding splits at exactly as written:
    matched on the raw text (not normalised, not only as a whole word) and stripping no
    neighbouring whitespace (`_special_tokens_split`). () when it lists none."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None)
    if not isinstance(decoder, dict) or getattr(tokenizer, "split_special_tokens", False):
        return ()
    return tuple(str(t) for t in decoder.values()
                 if str(t) and not any(getattr(t, flag, True) for flag in ("lstrip", "rstrip", "single_word",
                                                                          "normalized")))


@functools.lru_cache(maxsize=8)
def _opening_pattern(tokens: tuple[str, ...]) -> re.Pattern | None:
    """A regex matching any of `tokens` where none is a prefix of another (then at most one
    matches at a position), else None."""
    if any(a != b and b.startswith(a) for a in tokens for b in tokens):
        return None
    return re.compile("|".join(map(re.escape, tokens)))


def _im_end_stands_alone(tokenizer: Any, splitting: tuple[str, ...]) -> bool:
    """True when every written `<|im_end|>` encodes as that token: it splits as written
    (it is in `splitting`, the tokenizer's `_splitting_tokens`) and no other added token can
    match over it (added tokens match leftmost, then longest): none holds it, and none ends
    with a proper prefix of it."""
    if IM_END_TEXT not in splitting:
        return False
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    heads = tuple(IM_END_TEXT[:k] for k in range(1, len(IM_END_TEXT)))
    return not any(t != IM_END_TEXT and (IM_END_TEXT in t or t.endswith(heads)) for t in map(str, decoder.values()))


def _special_tokens_split(tokenizer: Any) -> bool:
    """True when `<|im_end|>` is an added token that strips no neighbouring whitespace, so
    encoding splits at it (incremental drift relies on `encode(a + b) == encode(a) + encode(b)`
    for `a` ending with it)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None)
    token = decoder.get(IM_END) if isinstance(decoder, dict) else None
    return token is not None and str(token) == IM_END_TEXT and not getattr(token, "lstrip", True) \
        and not getattr(token, "rstrip", True)
