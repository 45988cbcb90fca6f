"""Token-in, token-out (TITO): per-execution call store, normalisation, prefix matching.

DESIGN.md "Token-in, token-out". The trainer never re-tokenises text: for every call the
proxy keeps the exact ids the engine saw and sampled, and a new request reuses them
wherever it extends an earlier call.

Contract:
- `normalise(messages, tool_args)` maps harness noise onto one canonical form: a list of
  text parts becomes one string, `None` content becomes "", `cache_control` markers and
  unknown keys are dropped, and each tool call's arguments are restored from `tool_args`
  (tool-call id → the raw argument payload we emitted) when they parse to the same JSON,
  so a harness that re-serialises arguments (spacing, key order, \\u escapes) still
  matches. Messages are compared by `message_key`, which holds tool-call arguments as
  parsed JSON and ignores `reasoning_content` (harnesses drop or keep it at will).
- `CallStore.match(messages, tools) -> Match`:
  1. *Extension.* Find the recorded call c (same tools; the system prompt is a message)
     whose `c.messages + [c.answer]` is the longest message-level prefix of the request.
     The matched messages are replaced by c's recorded ones and the request is rendered;
     c's conversation rendered without a generation prompt, cut right after its last
     `<|im_end|>`, must be a string prefix of it. Then
     `prompt_ids = c.full_ids (+ <|im_end|> unless c's completion ended with it) + encode(suffix)`,
     the suffix starting with "\\n<|im_start|>". parent = c, prefix_len = len(c.full_ids).
  2. *Branch.* Otherwise (no such call, or the rendered text is not an extension, e.g. a
     template that drops earlier thinking) the whole request is rendered and encoded, and
     the recorded call sharing the longest common token prefix with it becomes the parent
     (prefix_len = that length; parent None and 0 when nothing is shared). Never raises
     for a mismatch.
- `CallStore.fresh(messages, tools) -> Match`: the request rendered alone, parent None
  (auxiliary calls: counted, answered and published, never recorded).
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
disagreement; an unpaired chunk counts all its unsampled positions. It is 0 for a
BPE-stable template (every template boundary is a special token). A branch is a fresh
tokenisation, so its drift is 0.

Memory: a call stores only the ids after its prefix (`own_ids`, int32) and a reference to
its parent, so an execution of N calls over L tokens keeps O(L) ids, not O(N·L).
"""
from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import orjson

from gyre.tokenizer import IM_END

IM_END_TEXT = "<|im_end|>"

Renderer = Callable[..., str]


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
        return arguments
    return orjson.dumps(arguments).decode()


def _tool_call(tc: dict, tool_args: dict[str, str]) -> dict:
    fn = tc.get("function") or {}
    name = fn.get("name") if isinstance(fn, dict) else None
    args = _args_text(fn.get("arguments", "") if isinstance(fn, dict) else "")
    tc_id = tc.get("id") or ""
    raw = tool_args.get(tc_id) if tc_id else None
    if raw is not None and raw != args and _parse_json(raw) == _parse_json(args):
        args = raw
    return {"id": tc_id, "type": "function", "function": {"name": name or "", "arguments": args}}


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
    reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning:
        out["reasoning_content"] = reasoning
    return out


def normalise(messages: Iterable[dict], tool_args: dict[str, str] | None = None) -> list[dict]:
    """Canonical form of a request's messages. Raises ValueError on a malformed message."""
    return [normalise_message(m, tool_args) for m in messages]


def normalise_tools(tools: Any) -> list[dict]:
    """Tools without `cache_control` markers; None and [] are the same (no tools)."""
    if not tools:
        return []
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ValueError("'tools' must be a list of objects")
    return _strip_cache_control(tools)


def _key_default(value: Any) -> Any:
    if isinstance(value, _Unparsed):
        return {"__unparsed__": value.text}
    raise TypeError


def message_key(message: dict) -> bytes:
    """Comparison key of a normalised message: tool-call arguments as parsed JSON,
    `reasoning_content` ignored. Equal keys ⇔ the same message for TITO."""
    key: dict[str, Any] = {k: v for k, v in message.items() if k not in ("reasoning_content", "tool_calls")}
    if message.get("tool_calls"):
        key["tool_calls"] = [
            {"id": tc["id"], "name": tc["function"]["name"], "arguments": _parse_json(tc["function"]["arguments"])}
            for tc in message["tool_calls"]
        ]
    return orjson.dumps(key, option=orjson.OPT_SORT_KEYS, default=_key_default)


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
    """

    parent: CallRecord | None
    prefix_len: int
    prompt_ids: np.ndarray
    extended: bool
    drift: int
    messages: tuple[dict, ...]
    tools: tuple[dict, ...]
    digest: bytes

    @property
    def new_prompt_ids(self) -> np.ndarray:
        """(P - prefix_len,) int32: the prompt ids after the reused prefix."""
        return self.prompt_ids[self.prefix_len:]


# --------------------------------------------------------------------------- drift


def _chunks(ids: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) ranges split right after every <|im_end|>."""
    ends = (np.flatnonzero(ids == IM_END) + 1).tolist()
    if not ends or ends[-1] != len(ids):
        ends.append(len(ids))
    starts = [0, *ends[:-1]]
    return [(s, e) for s, e in zip(starts, ends) if e > s]


def count_drift(recorded: np.ndarray, sampled: np.ndarray, rendered: np.ndarray) -> int:
    """Prompt positions outside sampled spans where recorded and re-rendered ids disagree.

    recorded: (P,) int ids sent to the engine; sampled: (P,) bool, True where the model
    sampled the id; rendered: (R,) int, a fresh tokenisation of the rendered request.
    Alignment and counting rules: module docstring ("Drift").
    """
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
        else:
            m = min(len(a), len(b))
            drift += int((a[:m] != b[:m]).sum()) + abs(len(a) - len(b))
    return drift


def _lcp(a: Sequence[np.ndarray], b: np.ndarray) -> int:
    """Length of the common prefix of concat(a) and b."""
    pos = 0
    for seg in a:
        n = min(len(seg), len(b) - pos)
        if n <= 0:
            break
        eq = seg[:n] == b[pos:pos + n]
        if not eq.all():
            return pos + int(np.argmin(eq))
        pos += n
        if n < len(seg):
            break
    return pos


# --------------------------------------------------------------------------- store


class CallStore:
    """The calls of one execution and the raw tool-call payloads we emitted.

    tokenizer: an HF tokenizer (`gyre.tokenizer.build_tokenizer()` or the model's).
    render: `gyre.chat.render(tokenizer, messages, tools, add_generation_prompt)`.
    check_drift: encode the whole rendered request on extensions to count drift
      (O(prompt) tokenizer work per call); False skips it and reports drift 0.
    Not thread-safe; one event loop owns it.
    """

    def __init__(self, tokenizer: Any, *, render: Renderer | None = None, check_drift: bool = True):
        if render is None:
            from gyre.chat import render as chat_render

            render = chat_render
        self.tokenizer = tokenizer
        self.render = render
        self.check_drift = check_drift
        self.calls: list[CallRecord] = []
        self.tool_args: dict[str, str] = {}
        self._by_conv: dict[bytes, CallRecord] = {}
        self._extended: set[str] = set()

    # -- helpers
    def encode(self, text: str) -> np.ndarray:
        """(N,) int32 ids of `text`, no special tokens added (special-token text is parsed)."""
        return np.asarray(self.tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int32)

    def _render(self, messages: Sequence[dict], tools: Sequence[dict], gen: bool) -> str:
        return self.render(self.tokenizer, list(messages), list(tools) or None, gen)

    def normalise(self, messages: Iterable[dict]) -> list[dict]:
        return normalise(messages, self.tool_args)

    # -- matching
    def match(self, messages: Sequence[dict], tools: Any = None) -> Match:
        """Attach a request to the recorded calls (module docstring). Raises ValueError
        on malformed messages or tools, and whatever `render` raises on a request the
        template cannot render."""
        msgs = self.normalise(messages)
        tools_n = tuple(normalise_tools(tools))
        seed = orjson.dumps(list(tools_n), option=orjson.OPT_SORT_KEYS)
        keys = [message_key(m) for m in msgs]
        digests = _chain(seed, keys)
        for k in range(len(msgs), 0, -1):
            c = self._by_conv.get(digests[k])
            if c is None:
                continue
            found = self._extend(c, msgs[k:], tools_n, digests[-1])
            if found is not None:
                return found
            break  # the longest message-level match is not a token-level extension
        return self._branch(msgs, tools_n, digests[-1])

    def fresh(self, messages: Sequence[dict], tools: Any = None) -> Match:
        """A request rendered and encoded on its own, attached to nothing (parent None):
        for auxiliary calls (token counting, titles) that must not shape the trajectory
        tree. Raises like `match`."""
        msgs = self.normalise(messages)
        tools_n = tuple(normalise_tools(tools))
        prompt = self.encode(self._render(msgs, tools_n, True))
        return Match(parent=None, prefix_len=0, prompt_ids=prompt, extended=False, drift=0,
                     messages=tuple(msgs), tools=tools_n, digest=b"")

    def _extend(self, c: CallRecord, rest: list[dict], tools: tuple[dict, ...], digest: bytes) -> Match | None:
        conv = (*c.messages, c.answer)
        text = self._render((*conv, *rest), tools, True)
        prev = self._render(conv, tools, False)
        cut = prev.rfind(IM_END_TEXT)
        if cut < 0:
            return None
        prev = prev[: cut + len(IM_END_TEXT)]
        if not text.startswith(prev):
            return None
        head = c.full_ids()
        parts = [head]
        if not c.stopped:
            parts.append(np.asarray([IM_END], np.int32))
        parts.append(self.encode(text[len(prev):]))
        prompt = np.concatenate(parts)
        drift = 0
        if self.check_drift:
            sampled = np.zeros(len(prompt), bool)
            sampled[: len(head)] = c.sampled_mask(len(head))
            drift = count_drift(prompt, sampled, self.encode(text))
        return Match(parent=c, prefix_len=len(head), prompt_ids=prompt, extended=True, drift=drift,
                     messages=(*conv, *rest), tools=tools, digest=digest)

    def _branch(self, msgs: list[dict], tools: tuple[dict, ...], digest: bytes) -> Match:
        prompt = self.encode(self._render(msgs, tools, True))
        best: CallRecord | None = None
        best_len = 0
        for rec in self.calls:
            if rec.call in self._extended:
                continue  # a child that extends it shares at least as long a prefix
            n = _lcp(rec.segments(), prompt)
            if n > best_len or (n == best_len and best is not None and n > 0 and rec.seq > best.seq):
                best, best_len = rec, n
        # Attach at the call that first held the shared ids.
        while best is not None and best.parent is not None and best_len <= best.prefix_len:
            best = best.parent
        if best_len == 0:
            best = None
        return Match(parent=best, prefix_len=best_len, prompt_ids=prompt, extended=False, drift=0,
                     messages=tuple(msgs), tools=tools, digest=digest)

    # -- recording
    def record(self, match: Match, *, call: str, seq: int, answer: dict,
               completion_ids: Sequence[int]) -> CallRecord:
        """Add a served call. answer: the assistant message returned to the harness, with
        tool-call `arguments` exactly as emitted; they are cached by tool-call id.
        completion_ids: (C,) sampled ids, stop token included when the engine stopped."""
        answer_n = normalise_message(answer)
        for tc in answer_n.get("tool_calls", ()):
            if tc["id"]:
                self.tool_args[tc["id"]] = tc["function"]["arguments"]
        comp = np.asarray(completion_ids, dtype=np.int32)
        own = np.concatenate([match.new_prompt_ids, comp]).astype(np.int32, copy=False)
        conv_key = hashlib.sha256(match.digest + message_key(answer_n)).digest()
        rec = CallRecord(call=call, seq=seq, parent=match.parent, prefix_len=match.prefix_len, own_ids=own,
                         completion_len=len(comp), messages=match.messages, tools=match.tools,
                         answer=answer_n, conv_key=conv_key)
        self.calls.append(rec)
        self._by_conv[conv_key] = rec
        if match.parent is not None and match.prefix_len == match.parent.full_len:
            self._extended.add(match.parent.call)
        return rec

    def get(self, call: str) -> CallRecord | None:
        for rec in reversed(self.calls):
            if rec.call == call:
                return rec
        return None
