"""What a harness's request is reduced to before TITO matching (`gyre.serving.tito`).

Contract:
- `normalise(messages, tool_args)` maps harness noise onto one canonical form: a list of
  text parts becomes one string, `None` content becomes "", `cache_control` markers and
  unknown keys are dropped, and each tool call's arguments are restored from `tool_args`
  (tool-call id → the raw argument payload we emitted) when they parse to the same JSON
  (or are `{"input": payload}`: a custom tool call answered with the whole payload as
  its input), so a harness that re-serialises arguments (spacing, key order, \\u
  escapes) still matches. Messages are compared by `message_key`, which holds tool-call arguments as
  parsed JSON and ignores `reasoning_content` (harnesses drop or keep it at will).
  `normalise_message` does one message; both raise ValueError on a malformed message (not
  an object with a string `role`, `tool_calls` not a list of objects, a tool call without a
  string function name, an id or name that is not a string).
- `normalise_tools(tools)`: tools without their `cache_control` markers; ValueError when
  they are not a list of objects.
- For the store's incremental normalisation: `equal_prefix_len` (how much of a resent
  history equals an earlier request's), `_tools_json` (a request's tools as sent) and
  `_chain` (cumulative digests naming the tools and the first k messages).
- `_text_chars(messages, tools)`: an estimate of the rendering's length (`MESSAGE_CHARS`
  per message and tool call besides the text), which decides `gyre.serving.tito.Pending.heavy`.
No tokenizer, no state.
"""
from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable, Sequence
from typing import Any

import orjson

from gyre.serving.chat import call_function


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


MESSAGE_CHARS = 100
"""What `_text_chars` counts for each message and tool call besides its text: the template's
framing (`<|im_start|>role\n`, `<tool_call>` with the name, `<tool_response>`…), ≈ 60–90
characters, and rendering's fixed cost per message (Jinja), so many short messages are heavy
too."""


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
