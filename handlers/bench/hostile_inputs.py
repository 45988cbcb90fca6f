"""What `gyre bench hostile` sends: malformed and hostile requests and events, generated with
Hypothesis from a seed, and the steady client's good turns (BENCHMARKS.md "gyre bench
hostile").

- `bad_requests(seed, n)` → n `Hostile` requests over OpenAI Chat, Responses and Anthropic
  Messages: a valid body with one part replaced by a value of another type, removed, or
  buried under unknown keys; huge values (a 2 MB string, 150,000 messages) and deep
  nesting (JSON 20,000 levels deep); bad encodings (bytes that are not UTF-8 or not JSON, a
  gzip header on garbage, an encoding the proxy does not speak, a body cut short); unknown
  ids (a tool output for no call, `previous_response_id`, an `item_reference`); wrong keys
  (none, forged, another run's) and wrong methods and paths. Each names the `kind` it was
  drawn as.
- `bad_events(name, seed, n)` → n payloads for subject `name` that gyre's own codec refuses
  (`schemas.decode` raises): arbitrary bytes, JSON that is not an object, a valid-shaped
  event missing a required field or holding a value of another type (one of them huge), JSON
  nested past the decoder's depth, an event cut short. Only payloads `schemas.decode`
  refuses are kept, so every one must be dead-lettered by every consumer of `name`.
- `good_body(api, history)` / `answer_turn(api, answer)`: the steady client's requests, an
  agent whose history grows by its own answers and a user message.

Pure: no I/O (handlers/bench/hostile.py sends them).
"""
from __future__ import annotations

import dataclasses
import gzip
import json
import types
import typing
import warnings
from typing import Any

import orjson

import schemas

API_PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}
GOOD_MAX_TOKENS = 8

_BASH = {"name": "bash", "description": "run a command",
         "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}
TOOLS = {"chat": [{"type": "function", "function": _BASH}],
         "responses": [{"type": "function", **_BASH}],
         "messages": [{"name": _BASH["name"], "description": _BASH["description"], "input_schema": _BASH["parameters"]}]}


@dataclasses.dataclass(frozen=True, slots=True)
class Hostile:
    """One hostile request. body: its bytes, or for a huge one (`huge`: what, size) made
    when sent (`payload`), so a thousand requests do not sit in memory at once. key:
    `valid` (the execution's own), `none`, `forged` (right form, wrong MAC) or `other`
    (another run's secret). encoding: Content-Encoding header ('' = none)."""

    kind: str
    api: str
    method: str
    path: str
    body: bytes = b""
    key: str = "valid"
    encoding: str = ""
    content_type: str = "application/json"
    huge: tuple[str, int] | None = None

    def payload(self) -> bytes:
        if self.huge is None:
            return self.body
        what, size = self.huge
        body = _template(self.api, False)
        field = "input" if self.api == "responses" else "messages"
        if what == "string":  # a 1-2 MB message: rendered, tokenised, refused as too long for the context
            body[field][-1]["content"] = "x" * size
        elif what == "messages":  # past the 100,000 messages one request may hold
            body[field] = body[field] * size
        else:  # a number JSON holds and no 64-bit integer does
            body["max_output_tokens" if self.api == "responses" else "max_tokens"] = 10 ** size
        return json.dumps(body).encode()


def good_body(api: str, history: list[dict], stream: bool = False) -> dict:
    """A valid request of `api` whose conversation is `history` (the API's own message or
    item form), with the bash tool and a small completion cap."""
    if api == "chat":
        return {"model": "gyre", "messages": history, "tools": TOOLS[api], "max_tokens": GOOD_MAX_TOKENS,
                "stream": stream}
    if api == "responses":
        return {"model": "gyre", "input": history, "tools": TOOLS[api], "max_output_tokens": GOOD_MAX_TOKENS,
                "stream": stream}
    return {"model": "gyre", "max_tokens": GOOD_MAX_TOKENS, "messages": history, "tools": TOOLS[api], "stream": stream}


def first_turn(api: str, text: str) -> list[dict]:
    if api == "responses":
        return [{"type": "message", "role": "user", "content": text}]
    return [{"role": "user", "content": text}]


def answer_turn(api: str, answer: dict, text: str) -> list[dict]:
    """What a client appends to its history after `answer` (the API's non-streamed body):
    the answer as it came, a result for each tool call it made, and a user message `text`."""
    if api == "chat":
        msg = answer["choices"][0]["message"]
        out = [{k: v for k, v in msg.items() if v is not None}]
        out += [{"role": "tool", "tool_call_id": c["id"], "content": "ok"} for c in msg.get("tool_calls") or ()]
        return out + [{"role": "user", "content": text}]
    if api == "responses":
        items = [dict(item) for item in answer["output"]]
        items += [{"type": "function_call_output", "call_id": i["call_id"], "output": "ok"}
                  for i in items if i["type"] == "function_call"]
        return items + [{"type": "message", "role": "user", "content": text}]
    blocks = answer["content"]
    results = [{"type": "tool_result", "tool_use_id": b["id"], "content": "ok"} for b in blocks if b["type"] == "tool_use"]
    return [{"role": "assistant", "content": blocks}, {"role": "user", "content": [*results, {"type": "text", "text": text}]}]


# --------------------------------------------------------------------------- requests


def _strategies():
    """The Hypothesis strategies (imported here: Hypothesis is needed by this bench only)."""
    from hypothesis import strategies as st

    scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                        st.text(max_size=40))
    values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                           st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                          max_leaves=12)
    return st, values


def _dumps(value: Any) -> bytes:
    """JSON of a generated value: the standard library's, which writes integers beyond 64
    bits (and the non-JSON Infinity a float may be, itself a malformed body)."""
    return json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path (keys and indices) into a JSON value, the root excluded."""
    out = []
    if isinstance(value, dict):
        for k, v in value.items():
            out.append((*prefix, k))
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out.append((*prefix, i))
            out += _paths(v, (*prefix, i))
    return out


def _replaced(body: Any, path: tuple, value: Any, delete: bool = False) -> Any:
    body = orjson.loads(orjson.dumps(body))  # a deep copy
    node = body
    for step in path[:-1]:
        node = node[step]
    if delete:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return body


def _template(api: str, stream: bool) -> dict:
    history = first_turn(api, "List the files.")
    if api == "chat":
        history = [{"role": "system", "content": "You are careful."}, *history]
    return good_body(api, history, stream)


def _request_strategy():
    st, values = _strategies()
    apis = st.sampled_from(sorted(API_PATHS))

    @st.composite
    def mutated(draw):  # one part of a valid body replaced, removed, or buried under unknown keys
        api, stream = draw(apis), draw(st.booleans())
        body = _template(api, stream)
        path = draw(st.sampled_from(_paths(body)))
        how = draw(st.sampled_from(["replace", "delete", "unknown_keys"]))
        if how == "replace":
            body = _replaced(body, path, draw(values))
        elif how == "delete":
            body = _replaced(body, path, None, delete=True)
        else:
            body.update(draw(st.dictionaries(st.text(min_size=1, max_size=12), values, min_size=1, max_size=3)))
        return Hostile(f"body_{how}", api, "POST", API_PATHS[api], _dumps(body))

    @st.composite
    def huge(draw):
        api = draw(apis)
        what = draw(st.sampled_from(["string", "messages", "number"]))
        size = draw({"string": st.integers(1_000_000, 2_000_000), "messages": st.integers(100_001, 150_000),
                     "number": st.integers(20, 400)}[what])
        return Hostile(f"huge_{what}", api, "POST", API_PATHS[api], huge=(what, size))

    @st.composite
    def deep(draw):
        api, depth = draw(apis), draw(st.integers(2_000, 20_000))
        nested = b"[" * depth + b"]" * depth
        body = orjson.dumps(_template(api, False)).replace(b'"List the files."', nested)
        return Hostile("deep", api, "POST", API_PATHS[api], body)

    @st.composite
    def encoding(draw):
        api = draw(apis)
        raw = orjson.dumps(_template(api, False))
        how = draw(st.sampled_from(["not_utf8", "not_json", "cut", "gzip_garbage", "gzip_bomb", "unknown_encoding",
                                    "text_plain"]))
        if how == "not_utf8":
            return Hostile("encoding_not_utf8", api, "POST", API_PATHS[api],
                           raw.replace(b"List", b"\xff\xfe\xc3\x28") + draw(st.binary(max_size=20)))
        if how == "not_json":
            return Hostile("encoding_not_json", api, "POST", API_PATHS[api], draw(st.binary(min_size=1, max_size=200)))
        if how == "cut":
            return Hostile("encoding_cut", api, "POST", API_PATHS[api], raw[:draw(st.integers(1, len(raw) - 1))])
        if how == "gzip_garbage":
            return Hostile("encoding_gzip_garbage", api, "POST", API_PATHS[api],
                           b"\x1f\x8b\x08\x00" + draw(st.binary(max_size=100)), encoding="gzip")
        if how == "gzip_bomb":  # 64 MiB of zeros in a few KB: the decoded size is bounded
            return Hostile("encoding_gzip_bomb", api, "POST", API_PATHS[api],
                           gzip.compress(raw[:-1] + b"," + b" " * (64 << 20) + b"}", 9, mtime=0), encoding="gzip")
        if how == "unknown_encoding":
            return Hostile("encoding_unknown", api, "POST", API_PATHS[api], raw,
                           encoding=draw(st.sampled_from(["br", "compress", "x-gyre"])))
        return Hostile("encoding_text_plain", api, "POST", API_PATHS[api], b"hello", content_type="text/plain")

    @st.composite
    def unknown_ids(draw):
        api = draw(apis)
        tc = draw(st.sampled_from(["call_nope", "", "toolu_nope", "x" * 300]))
        if api == "chat":
            history = [*first_turn(api, "go"), {"role": "tool", "tool_call_id": tc, "content": "x"}]
            body = good_body(api, history)
        elif api == "messages":
            body = good_body(api, [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": tc,
                                                                  "content": "x"}]}])
        else:
            body = good_body(api, [*first_turn(api, "go"),
                                   draw(st.sampled_from([{"type": "function_call_output", "call_id": tc, "output": "x"},
                                                         {"type": "item_reference", "id": "msg_nope"}]))])
            if draw(st.booleans()):
                body["previous_response_id"] = "resp_nope"
        return Hostile("unknown_id", api, "POST", API_PATHS[api], orjson.dumps(body))

    @st.composite
    def wrong_key(draw):
        api = draw(apis)
        return Hostile("wrong_key", api, "POST", API_PATHS[api], orjson.dumps(_template(api, False)),
                       key=draw(st.sampled_from(["none", "forged", "other"])))

    @st.composite
    def wrong_route(draw):
        api = draw(apis)
        method, path = draw(st.sampled_from([("GET", API_PATHS[api]), ("PUT", API_PATHS[api]),
                                             ("POST", "/v1/nope"), ("POST", "/v2/chat/completions"),
                                             ("DELETE", "/v1/messages/count_tokens"), ("GET", "/v1/responses/resp_x")]))
        return Hostile("wrong_route", api, method, path, orjson.dumps(_template(api, False)))

    # Weights: mostly malformed bodies, a share of each other kind.
    return st.one_of(mutated(), mutated(), mutated(), mutated(), unknown_ids(), encoding(), wrong_key(),
                     wrong_route(), deep(), huge())


class _Enough(Exception):
    """Raised from inside the Hypothesis loop once enough examples are kept."""


def _collect(strategy, seed: int, n: int, keep=lambda x: True) -> list:
    """n examples of `strategy` drawn deterministically from `seed` (Hypothesis: no
    database, no shrinking), keeping those `keep` accepts; fewer when 20·n draws do not
    yield n."""
    from hypothesis import HealthCheck, Phase, Verbosity, given, seed as with_seed, settings

    out: list = []

    @with_seed(seed)
    @settings(max_examples=20 * n, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet, report_multiple_bugs=False)
    @given(strategy)
    def draw(example):
        if keep(example):
            out.append(example)
        if len(out) >= n:
            raise _Enough

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Hypothesis's notes on the huge examples' reprs
        try:
            draw()
        except _Enough:
            pass
    return out[:n]


def bad_requests(seed: int, n: int) -> list[Hostile]:
    """n hostile requests (module docstring), deterministic in `seed`."""
    return _collect(_request_strategy(), seed, n)


# --------------------------------------------------------------------------- events


def _sample(hint: Any) -> Any:
    """A plausible JSON value of a schema annotation (a template to break)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return "x"
    if origin in (typing.Union, types.UnionType):
        return _sample(next(a for a in args if a is not type(None)))
    if origin is typing.Literal:
        return args[0]
    if origin is tuple:
        return [] if len(args) == 2 and args[1] is Ellipsis else [_sample(a) for a in args]
    if origin is dict:
        return {}
    if hint in (bool, int, float, str):
        return {bool: True, int: 1, float: 0.5, str: "x"}[hint]
    if dataclasses.is_dataclass(hint):
        hints = typing.get_type_hints(hint)
        return {f.name: _sample(hints[f.name]) for f in dataclasses.fields(hint)}
    return None


def event_template(name: str) -> dict:
    """Every field of event `name` with a plausible value."""
    cls = schemas.event_types()[name]
    hints = typing.get_type_hints(cls)
    return {f.name: _sample(hints[f.name]) for f in dataclasses.fields(cls) if f.name in hints}


def _refused(name: str, data: bytes) -> bool:
    try:
        schemas.decode(name, data)
    except (schemas.SchemaError, ValueError, RecursionError):
        return True
    return False


def _event_strategy(name: str):
    st, values = _strategies()
    template = event_template(name)
    fields = sorted(template)

    @st.composite
    def wrong_field(draw):
        field = draw(st.sampled_from(fields))
        return _dumps({**template, field: draw(values)})

    @st.composite
    def missing_field(draw):
        field = draw(st.sampled_from(fields))
        return orjson.dumps({k: v for k, v in template.items() if k != field})

    @st.composite
    def huge_field(draw):
        field = draw(st.sampled_from([f for f in fields if not isinstance(template[f], str)] or fields))
        return orjson.dumps({**template, field: "x" * draw(st.integers(100_000, 600_000))})

    @st.composite
    def cut(draw):
        raw = orjson.dumps(template)
        return raw[:draw(st.integers(0, len(raw) - 1))]

    deep = st.integers(1_100, 50_000).map(lambda d: b'{"event_id": ' + b"[" * d + b"]" * d + b"}")
    not_object = values.filter(lambda v: not isinstance(v, dict)).map(_dumps)
    return st.one_of(wrong_field(), wrong_field(), missing_field(), huge_field(), cut(), deep, not_object,
                     st.binary(max_size=300), st.binary(max_size=40).map(lambda b: b"\xff" + b))


def bad_events(name: str, seed: int, n: int) -> list[bytes]:
    """n payloads for subject `name` that `schemas.decode(name, …)` refuses, deterministic in `seed`."""
    return _collect(_event_strategy(name), seed, n, keep=lambda data: _refused(name, data))
