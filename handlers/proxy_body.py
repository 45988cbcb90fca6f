"""Request bodies that resend a history, parsed only where they are new.

A harness resends its whole conversation on every call: after 50 calls of a bench
execution a 57-KB body, after an hour of an agent's rollout ~4 MB for ~1M tokens. Parsing
that whole body (`orjson.loads`: ≈ 70 µs for 57 KB here, 9–18 ms at 680k tokens) and then
comparing the parsed history with the previous request's (`gyre.tito`, `MessageMemo`: a
walk over cold objects) costs O(history) on the event loop for every call.

Contract: `BodyMemo.loads(raw, field)` returns what `orjson.loads(raw)` returns (equal
values; raises `orjson.JSONDecodeError` the same way), where `field` names the top-level
array that holds the history (`messages`; Responses' `input`). When `raw` begins with the
bytes of an earlier body of the execution through the end of its array's element j, and
after its array ends with that body's bytes (the other fields unchanged), then:
- elements 0..j are that body's parsed objects (the same objects, so the comparisons
  downstream are identity checks in C), and only the new elements are parsed;
- the other top-level values are that body's (the same objects).
Equal bytes parse to equal values, so this is exact; anything else (a first call, a body
whose bytes differ before the array or after it, an array holding a number or a literal,
a field that is missing, not an array, or present twice) is parsed whole.

The byte layout of a body (where the array starts, where each element ends, where the
array closes) is found by regular expressions that match one whole JSON value each (a
string with its escapes; an object or array with balanced brackets, strings matched whole,
at most `MAX_DEPTH` deep), so the scan runs in C with one Python step per top-level key and
per element. A body parsed whole is scanned once, when a later body is first compared with
it; an extension scans only its new elements (≈ 8 µs for the bench's two new messages). Callers must not
mutate what `loads` returns (the objects are shared with later bodies).

Memory: the latest `size` bodies' bytes (a ~1M-token execution's main line: ≈ 4 MB) beside
the parsed objects the execution's memos keep anyway.
"""
from __future__ import annotations

import bisect
import dataclasses
import re
from typing import Any

import numpy as np
import orjson

_STRING = rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"'
"""A JSON string, escapes included."""
MAX_DEPTH = 24
"""Deepest nesting of an array element that is matched (deeper: the body is parsed whole)."""


def _container(depth: int) -> bytes:
    """An object or array nested at most `depth` deep, its brackets balanced. In valid JSON
    it ends exactly at the bracket that closes its first one (strings are matched whole,
    so brackets inside them are never seen)."""
    inner = _STRING + rb"|[^\"{}\[\]]++" + (b"|" + _container(depth - 1) if depth > 1 else b"")
    return rb"[{\[](?:" + inner + rb")*+[}\]]"


_WS = rb"[ \t\n\r]*+"
_ITEM = re.compile(_WS + b"(" + _STRING + b"|" + _container(MAX_DEPTH) + b")" + _WS + rb"([,\]])")
"""One array element that ends itself (a string, object or array), then `,` or `]`."""
_EMPTY = re.compile(_WS + rb"\]")
_KEY = re.compile(_WS + b"(" + _STRING + b")" + _WS + b":" + _WS)
_VALUE = re.compile(b"(?:" + _STRING + b"|" + _container(MAX_DEPTH) + rb"|[-+.0-9a-zA-Z]++)" + _WS + rb"([,}])")
"""A top-level value (scalars included), then `,` or `}`."""
_AFTER_ARRAY = re.compile(rb"\]" + _WS + rb"([,}])")
_OPEN_OBJECT = re.compile(_WS + rb"\{" + _WS)
_SPACE = b" \t\n\r"
_COMMA, _BRACKET = ord(","), ord("]")


@dataclasses.dataclass(slots=True)
class _Layout:
    """Where a body's history array lies: `start` right after its `[`, `ends[i]` right
    after element i's closing `}` or `"` (strictly increasing), `close` at its `]`."""

    start: int
    ends: list[int]
    close: int


@dataclasses.dataclass(slots=True)
class _Body:
    raw: bytes
    field: str
    body: dict
    layout: _Layout | None = None
    scanned: bool = False  # layout looked for (None then: this body cannot be reused)

    def layout_of(self) -> _Layout | None:
        if not self.scanned:
            self.layout, self.scanned = _layout(self.raw, self.field, len(self.body[self.field])), True
        return self.layout


def _elements(raw: bytes, pos: int) -> tuple[list[int], int] | None:
    """Scan an array from `pos` (right after its `[`, or at the `,` after an element) to its
    closing `]`: (the end of each element after pos, the index of the `]`). None when an
    element is not an object, array or string (its end is not self-delimiting), nests
    deeper than `MAX_DEPTH`, or the text is not such an array there."""
    ends: list[int] = []
    if raw[pos] == _COMMA:
        pos += 1
    elif m := _EMPTY.match(raw, pos):
        return ends, m.end() - 1
    while m := _ITEM.match(raw, pos):
        ends.append(m.end(1))
        if m.group(2) == b"]":
            return ends, m.start(2)
        pos = m.end()
    return None


def _layout(raw: bytes, field: str, n: int) -> _Layout | None:
    """The layout of `field`'s array in the JSON object `raw` (already parsed: valid), or
    None unless it is the only top-level key that decodes to `field`, its value an array
    of `n` objects, arrays or strings."""
    m = _OPEN_OBJECT.match(raw)
    if m is None or raw[m.end():m.end() + 1] == b"}":
        return None
    found: _Layout | None = None
    pos = m.end()
    while key := _KEY.match(raw, pos):
        pos = key.end()
        if orjson.loads(key.group(1)) == field:
            if found is not None or raw[pos:pos + 1] != b"[":
                return None
            got = _elements(raw, pos + 1)
            if got is None or len(got[0]) != n:
                return None
            found = _Layout(pos + 1, *got)
            m = _AFTER_ARRAY.match(raw, got[1])
        else:
            m = _VALUE.match(raw, pos)
        if m is None:
            return None
        if m.group(1) == b"}":
            return found
        pos = m.end()
    return None


class BodyMemo:
    """One execution's latest request bodies (module docstring). Not thread-safe: one
    event loop's."""

    def __init__(self, size: int = 4):
        self.size = size
        self._bodies: list[_Body] = []  # newest first
        self.reused = 0
        """Bodies parsed only in part (a counter for tests and diagnosis)."""

    def loads(self, raw: bytes, field: str) -> Any:
        """`orjson.loads(raw)`, reusing an earlier body's parsed history (module docstring).
        raw: the request body (bytes, decompressed). Raises orjson.JSONDecodeError."""
        best: _Body | None = None
        shared = -1
        for old in self._bodies:
            if old.field != field:
                continue
            lay = old.layout_of()
            if lay is None or len(lay.ends) <= shared + 1:
                continue
            j = _shared(raw, old.raw, lay.ends)
            if j > shared:
                best, shared = old, j
        body = self._extend(raw, best, shared) if best is not None else None
        if body is None:
            body = orjson.loads(raw)
            if not (isinstance(body, dict) and isinstance(body.get(field), list)):
                return body  # not a history (an error for the caller to name): nothing to keep
            entry = _Body(raw, field, body)
        else:
            entry = body
            body = entry.body
            self.reused += 1
        if best is not None:
            self._bodies.remove(best)  # this line's tip moves on
        self._bodies.insert(0, entry)
        del self._bodies[self.size:]
        return body

    def _extend(self, raw: bytes, old: _Body, j: int) -> _Body | None:
        """`raw` as `old`'s elements 0..j plus its new elements, or None when it is not that:
        `raw` is old's bytes through element j, `,` and a list of values (parsed here) or
        nothing, then old's bytes from its array's `]` on (the JSON grammar leaves one way
        to read that)."""
        if j < 0:
            return None
        lay = old.layout
        pos = lay.ends[j]
        while pos < len(raw) and raw[pos] in _SPACE:
            pos += 1
        close = len(raw) - (len(old.raw) - lay.close)  # where old's `]` and what follows would start
        if close < pos or not raw.startswith(memoryview(old.raw)[lay.close:], close):
            return None  # the fields after the array changed
        if pos == close:
            new: list = []
            ends: list[int] | None = []
        elif raw[pos] != _COMMA:
            return None
        else:
            try:
                new = orjson.loads(b"[" + raw[pos + 1:close] + b"]")
            except orjson.JSONDecodeError:
                return None  # parsed whole: the error names its place in the body
            ends = _new_ends(raw, pos, close, new)
            if not ends:
                return None
        body = dict(old.body)
        body[old.field] = old.body[old.field][:j + 1] + new
        return _Body(raw, old.field, body, _Layout(lay.start, lay.ends[:j + 1] + ends, close), scanned=True)


def _new_ends(raw: bytes, pos: int, close: int, new: list) -> list[int] | None:
    """The ends of `new`, the elements parsed from raw[pos + 1:close] (pos at a `,`): from
    their compact JSON when that is what the bytes are (orjson's, and JavaScript's
    `JSON.stringify`: one memcmp), else scanned (`_elements`). None when one does not end
    itself (a number or a literal)."""
    if not all(type(e) in (dict, list, str) for e in new):
        return None
    try:
        parts = [orjson.dumps(e) for e in new]
    except orjson.JSONEncodeError:
        parts = None
    if parts is not None and close - pos - 1 == sum(map(len, parts)) + len(parts) - 1 \
            and raw.startswith(b",".join(parts), pos + 1):
        ends, at = [], pos + 1
        for part in parts:
            at += len(part)
            ends.append(at)
            at += 1
        return ends
    got = _elements(raw, pos)
    return got[0] if got is not None and got[1] == close and len(got[0]) == len(new) else None


def _shared(raw: bytes, old: bytes, ends: list[int]) -> int:
    """The last element of `old` whose bytes (and all before it) `raw` begins with; -1: none.
    The last few are tried first (an extension; Claude Code's moved cache marker), then
    the first differing byte is found."""
    view = memoryview(old)
    for j in range(len(ends) - 1, max(len(ends) - 4, -1), -1):
        if raw.startswith(view[:ends[j]]):
            return j
    n = min(len(raw), ends[-1])
    differs = np.flatnonzero(np.frombuffer(raw, np.uint8, n) != np.frombuffer(old, np.uint8, n))
    first = int(differs[0]) if len(differs) else n
    return bisect.bisect_right(ends, first) - 1
