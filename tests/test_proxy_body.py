"""`handlers.proxy.body.BodyMemo`: a body that resends a history parses to exactly what
`orjson.loads` gives, reusing the earlier body's objects only where the bytes are equal."""
from __future__ import annotations

import json

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from handlers.proxy.body import MAX_DEPTH, MAX_ITEMS, BodyMemo

NASTY = ['"}, {"role": "user"}', "]]]}}}", "\\", '\\"', "\\\\\"", "é\u0301", "\u2028", "\x00\x1f", "🙂", "[", "{", ":", ","]


def _text() -> st.SearchStrategy[str]:
    return st.one_of(st.text(max_size=12), st.sampled_from(NASTY))


_leaf = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=False, allow_infinity=False),
                  _text())
_json = st.recursive(_leaf, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                  st.dictionaries(_text(), inner, max_size=3)), max_leaves=8)
_message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "tool", "system"]), "content": _text()},
                          optional={"tool_calls": st.lists(st.dictionaries(_text(), _json, max_size=3), max_size=2),
                                    "extra": _json}),
    st.dictionaries(_text(), _json, max_size=3),
    st.lists(_json, max_size=2),
    _text(),
)
_fields = st.dictionaries(st.sampled_from(["model", "tools", "stream", "max_tokens", "system", "x"]), _json, max_size=3)
DUMPS = [
    orjson.dumps,
    lambda o: json.dumps(o).encode(),
    lambda o: json.dumps(o, ensure_ascii=False).encode(),
    lambda o: json.dumps(o, indent=1).encode(),
    lambda o: json.dumps(o, separators=(",", ":")).encode(),
]


def body(before: dict, messages: list, after: dict, field: str = "messages") -> dict:
    out = {k: v for k, v in before.items() if k != field}
    out[field] = messages
    out.update({k: v for k, v in after.items() if k != field and k not in out})
    return out


def check(memo: BodyMemo, raw: bytes, field: str = "messages"):
    try:
        want = orjson.loads(raw)
    except orjson.JSONDecodeError:
        with pytest.raises(orjson.JSONDecodeError):
            memo.loads(raw, field)
        return None
    got = memo.loads(raw, field)
    assert same(got, want)
    return got


def same(a, b) -> bool:
    """Equal values of the same types, keys in the same order (`==` takes 1 == 1.0 == True).
    Iterative: bodies nest up to orjson's 1,024 levels."""
    todo = [(a, b)]
    while todo:
        a, b = todo.pop()
        if type(a) is not type(b):
            return False
        if isinstance(a, dict):
            if list(a) != list(b):
                return False
            todo.extend((a[k], b[k]) for k in a)
        elif isinstance(a, list):
            if len(a) != len(b):
                return False
            todo.extend(zip(a, b))
        elif repr(a) != repr(b):
            return False
    return True


_step = st.one_of(
    st.tuples(st.just("append"), st.lists(_message, min_size=1, max_size=3)),
    st.tuples(st.just("replace"), st.tuples(st.integers(0, 50), _message)),
    st.tuples(st.just("drop"), st.integers(1, 3)),
    st.tuples(st.just("before"), _fields),
    st.tuples(st.just("after"), _fields),
    st.tuples(st.just("dumps"), st.integers(0, len(DUMPS) - 1)),
    st.tuples(st.just("corrupt"), st.tuples(st.integers(0, 10**4), st.sampled_from(list(b'{}[],:" 1a\\')),
                                            st.booleans())),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_message, max_size=6), _fields, _fields, st.lists(_step, min_size=1, max_size=8),
       st.integers(0, len(DUMPS) - 1))
def test_any_sequence_of_bodies_parses_as_orjson_does(messages, before, after, steps, dumps):
    memo = BodyMemo()
    prev = check(memo, DUMPS[dumps](body(before, messages, after)))
    for kind, arg in steps:
        reused = memo.reused
        appended = False
        if kind == "append":
            messages = messages + arg
            appended = True
        elif kind == "replace" and messages:
            messages = list(messages)
            messages[arg[0] % len(messages)] = arg[1]
        elif kind == "drop":
            messages = messages[:-arg]
        elif kind == "before":
            before = arg
        elif kind == "after":
            after = arg
        elif kind == "dumps":
            dumps = arg
        raw = DUMPS[dumps](body(before, messages, after))
        if kind == "corrupt":  # one byte changed, dropped or added: often invalid, the rest as before
            at, byte, insert = arg
            at %= len(raw)
            check(memo, raw[:at] + bytes([byte]) + raw[at + (not insert):])
            prev = None  # (the memo's newest body may be the changed one)
            continue
        got = check(memo, raw)
        if appended and prev is not None and prev["messages"] and not any(
                isinstance(m, (int, float, bool)) or m is None for m in prev["messages"]):
            # a pure extension in the same serialiser: the old elements are the old objects
            assert memo.reused == reused + 1
            assert all(a is b for a, b in zip(got["messages"], prev["messages"]))
        prev = got


def test_the_bench_history_is_parsed_once():
    """50 calls of one execution: every body after the first two reuses the previous one's
    messages (the first body is scanned when the second arrives), and the tools object is
    the first body's."""
    memo = BodyMemo()
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
    messages = [{"role": "system", "content": "be careful"}, {"role": "user", "content": "fix it"}]
    first = None
    for k in range(50):
        got = check(memo, orjson.dumps({"model": "m", "messages": messages, "tools": tools, "max_tokens": 9}))
        first = first or got
        assert got["tools"] is first["tools"]
        assert got["messages"][0] is first["messages"][0]
        messages = messages + [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": f"c{k}", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}]},
            {"role": "tool", "tool_call_id": f"c{k}", "content": "a\nb \"quoted\" ]} {[" * 20}]
    assert memo.reused == 49


def test_a_moved_marker_reuses_the_messages_before_it():
    """Claude Code moves its cache_control marker to the newest message: the messages
    before the one that lost it are reused, that one and the new ones parsed."""
    memo = BodyMemo()
    msgs = [{"role": "user", "content": [{"type": "text", "text": f"m{i}"}]} for i in range(6)]
    marked = lambda ms: [*ms[:-1], {"role": "user", "content": [{**ms[-1]["content"][0], "cache_control": {"type": "ephemeral"}}]}]
    a = check(memo, orjson.dumps({"model": "m", "messages": marked(msgs), "system": "s"}))
    b = check(memo, orjson.dumps({"model": "m", "messages": marked(msgs + [{"role": "user", "content": [{"type": "text", "text": "n"}]}]),
                                  "system": "s"}))
    assert memo.reused == 1
    assert all(b["messages"][i] is a["messages"][i] for i in range(5))
    assert b["messages"][5] is not a["messages"][5] and "cache_control" not in b["messages"][5]["content"][0]


@pytest.mark.parametrize("second", [
    b'{"messages":[{"a":1},{"b":2}],"messages":[{"c":3}]}',  # a duplicate key: orjson keeps the last
    b'{"messages":[{"a":1},{"b":2}],"m\\u0065ssages":[{"c":3},{"d":4}]}',  # the same, escaped
    b'{"m\\u0065ssages":[{"c":3}],"messages":[{"a":1},{"b":2}]}',
    b'{"messages":[{"a":1},{"b":2},3]}',  # a number: its end is not its own
    b'{"messages":[{"a":1},{"b":2},{"c":[1,2]},]}',  # a trailing comma
    b'{"messages":[{"a":1},{"b":2},,{"c":1}]}',
    b'{"messages":[{"a":1},{"b":2},{"c":1}',  # cut short
    b'{"messages":[{"a":1},{"b":2} {"c":1}]}',
    b'{"messages":[{"a":1},{"b":2},{"c" 1}]}',
    b'{"messages":[{"a":1},{"b":2},{"c":1}]} x',
    b'{"messages":[{"a":1},{"b":2},{"c":"\\q"}]}',  # a bad escape
    b'{"messages":[{"a":1},{"b":2}]',
    b'{"messages":[{"a":1},{"b":2}], "max_tokens": 5}',  # a field after the array changed
    b'{"messages":[{"a":1},{"b":2}],"tools":[]}',
    b'{"messages":[{"a":1},{"b":2}]}',
    b'{"messages":[{"a":1}]}',
    b'{"messages":[{"a":1},{"b":2},' + b'[' * (MAX_DEPTH + 2) + b']' * (MAX_DEPTH + 2) + b']}',
    b'{"messages":[{"a":1},{"b":2},{"c":"]},{"}]}',
    b'{"messages":[{"a":1},{"b":2}, \n {"c":1}\n]\n}',
    b'{"messages":{"a":1}}',
    b'[{"messages":[]}]',
    b'{"messages":[{"a":1},{"b":2},{"c":1}]}',
    b'{"messages":[{"a":1},{"b":2],{"c":1}]}',  # broken where an old element ends
    b'{"messages":[{"a":1},{"b":2]]}',
    b'{"messages":[{"a":1},{"b":2}}',
    b'{"messages":[{"a":1},{"b":2}]]}',
    b'{"messages":[{"a":1},{"b":2}],}',
])
def test_bodies_that_are_not_plain_extensions_parse_as_orjson_does(second):
    memo = BodyMemo()
    check(memo, b'{"messages":[{"a":1},{"b":2}]}')
    check(memo, b'{"messages":[{"a":1},{"b":2}]}')  # scanned
    check(memo, second)
    check(memo, b'{"messages":[{"a":1},{"b":2},{"c":1},{"d":1}]}')


def test_a_first_body_that_is_not_one_to_extend_is_parsed_whole_each_time():
    deep = 300  # deeper than orjson writes (its compact JSON is not at hand) and than MAX_DEPTH (not scanned)
    for first in (b'{"messages":[{"a":1}],"messages":[{"a":1}]}', b'{"messages":[1,{"a":1}]}',
                  b'{"messages":[' + b'[' * deep + b']' * deep + b']}', b'{"x":1}',
                  b'{"messages":[' + b'[ ' * (MAX_DEPTH + 2) + b']' * (MAX_DEPTH + 2) + b']}'):  # not compact
        memo = BodyMemo()
        check(memo, first)
        check(memo, first[:-2] + b',{"b":2}]}' if first.endswith(b"]}") else first)
        assert memo.reused == 0


def test_responses_input_is_its_own_field():
    memo = BodyMemo()
    items = [{"type": "message", "role": "user", "content": "hi"}]
    a = check(memo, orjson.dumps({"model": "m", "instructions": "be brief", "input": items}), "input")
    b = check(memo, orjson.dumps({"model": "m", "instructions": "be brief", "input": items + [{"type": "x"}]}), "input")
    assert memo.reused == 1 and b["input"][0] is a["input"][0]
    # a body under another field name never shares these
    check(memo, orjson.dumps({"model": "m", "instructions": "be brief", "input": items + [{"type": "x"}]}), "messages")
    assert memo.reused == 1


def test_lines_whose_other_fields_differ_keep_their_own_tips():
    """Two lines sharing their messages but not the fields after them (one streams, one
    does not) each extend their own latest body; a body whose fields changed is parsed
    whole, and the next body extends it."""
    memo = BodyMemo()
    msgs = [{"role": "user", "content": f"m{i}"} for i in range(40)]
    for i in range(12):
        extra = {"stream": True} if i % 2 else {"max_tokens": 100}
        check(memo, orjson.dumps({"model": "m", "messages": msgs[:20 + i], **extra}))
    assert memo.reused == 10
    b = check(memo, orjson.dumps({"model": "m", "messages": msgs[:33], "max_tokens": 7}))  # changed: whole
    assert memo.reused == 10
    c = check(memo, orjson.dumps({"model": "m", "messages": msgs[:34], "max_tokens": 7}))
    assert memo.reused == 11 and c["messages"][32] is b["messages"][32]


def test_a_new_element_nested_past_orjsons_limit_still_fails():
    """orjson refuses 1,024 levels counted from the body's top: a new element that parses
    alone but not inside the body's object and array is refused as the whole body is."""
    memo = BodyMemo()
    check(memo, b'{"messages":[{"a":1}]}')
    check(memo, b'{"messages":[{"a":1}]}')
    for depth in (1020, 1021, 1022, 1023):
        check(memo, b'{"messages":[{"a":1},' + b"[" * depth + b"]" * depth + b"]}")


def test_a_history_of_more_elements_than_max_items_is_parsed_whole():
    memo = BodyMemo()
    many = [""] * (MAX_ITEMS + 1)
    check(memo, orjson.dumps({"messages": many}))
    check(memo, orjson.dumps({"messages": many + ["x"]}))
    assert memo.reused == 0


@pytest.mark.parametrize("api", ["chat", "messages", "responses", "count_tokens"])
def test_parsing_a_request_leaves_its_body_as_it_was(api):
    """The body's objects are shared with the execution's later bodies (`BodyMemo`): the
    request parsers must only read them."""
    import copy

    from handlers.proxy.call import _parse_count_tokens
    from handlers.proxy.anthropic import parse_messages_request
    from handlers.proxy.api import MessageMemo
    from handlers.proxy.openai import parse_chat_request
    from handlers.proxy.responses import parse_responses_request
    from schemas.call import SamplingParams

    marker = {"type": "ephemeral"}
    tool = {"name": "bash", "description": "run", "input_schema": {"type": "object"}, "cache_control": marker}
    bodies = {
        "chat": {"model": "m", "messages": [
            {"role": "system", "content": [{"type": "text", "text": "s", "cache_control": marker}]},
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": None, "reasoning_content": "r", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": {"command": "ls"}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "out"}]}],
            "tools": [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}],
            "stop": ["x"], "stream_options": {"include_usage": True}},
        "messages": {"model": "m", "system": [{"type": "text", "text": "s", "cache_control": marker}],
                     "messages": [
                         {"role": "user", "content": [{"type": "text", "text": "u", "cache_control": marker}]},
                         {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": "x"},
                                                           {"type": "tool_use", "id": "t1", "name": "bash",
                                                            "input": {"command": "ls"}}]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                       "content": [{"type": "text", "text": "out"}]}]}],
                     "tools": [tool], "stop_sequences": ["x"], "thinking": {"type": "enabled", "budget_tokens": 9}},
        "responses": {"model": "m", "instructions": "s", "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "d"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "u"}]},
            {"type": "function_call", "name": "bash", "arguments": "{}", "call_id": "c1"},
            {"type": "function_call_output", "call_id": "c1", "output": "out"}],
            "tools": [{"type": "function", "name": "bash", "parameters": {"type": "object"}},
                      {"type": "web_search"}], "stream": True},
    }
    bodies["count_tokens"] = bodies["messages"]
    parse = {"chat": parse_chat_request, "messages": parse_messages_request, "responses": parse_responses_request,
             "count_tokens": _parse_count_tokens}[api]
    body = orjson.loads(orjson.dumps(bodies[api]))
    before = copy.deepcopy(body)
    memo = MessageMemo()
    for _ in range(2):  # the second time through the memo's reused conversions
        parse(body, SamplingParams(), memo)
    assert same(body, before)
