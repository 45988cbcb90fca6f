"""`gyre bench hostile`: its inputs (seeded, malformed as claimed) and a smoke run of the
whole bench against a real toy run (about a minute)."""
from __future__ import annotations

import hashlib

import pytest

import schemas
from bus import subjects
from handlers.bench import hostile, hostile_inputs as inputs


def _digest(requests) -> str:
    return hashlib.sha256(b"".join(r.kind.encode() + r.method.encode() + r.path.encode() + r.payload()[:4096]
                                   for r in requests)).hexdigest()


def test_every_consumed_subject_is_covered():
    readers = hostile.consumed(cells=2)
    durables = {d for ds in readers.values() for d in ds}
    assert durables == {c.durable for c in subjects.CONSUMERS} | {"cell0-v1", "cell1-v1"}
    assert set(readers) == {n for c in subjects.CONSUMERS for n in c.names} | {schemas.CellSwitch.NAME}


@pytest.mark.parametrize("name", sorted(hostile.consumed(cells=1)))
def test_every_generated_event_is_refused_by_the_codec_and_the_seed_fixes_them(name):
    events = inputs.bad_events(name, seed=7, n=25)
    assert len(events) == 25 and events == inputs.bad_events(name, seed=7, n=25)
    for data in events:
        with pytest.raises((schemas.SchemaError, ValueError, RecursionError)):
            schemas.decode(name, data)
        assert len(data) < 1_000_000  # under NATS's max payload: each one is stored and delivered
    assert events != inputs.bad_events(name, seed=8, n=25)


def test_requests_are_seeded_and_span_the_kinds():
    requests = inputs.bad_requests(seed=3, n=120)
    assert len(requests) == 120 and _digest(requests) == _digest(inputs.bad_requests(seed=3, n=120))
    kinds = {r.kind.split("_")[0] for r in requests}
    assert {"body", "deep", "huge", "encoding"} <= kinds
    assert {r.api for r in requests} == {"chat", "responses", "messages"}
    assert _digest(requests) != _digest(inputs.bad_requests(seed=4, n=120))


def test_the_good_client_extends_its_own_history_in_each_api():
    chat = {"choices": [{"message": {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "bash", "arguments": "{}"}}]}}]}
    assert inputs.answer_turn("chat", chat, "go")[1] == {"role": "tool", "tool_call_id": "call_0", "content": "ok"}
    responses = {"output": [{"type": "function_call", "call_id": "call_1", "name": "bash", "arguments": "{}"}]}
    assert inputs.answer_turn("responses", responses, "go")[1]["call_id"] == "call_1"
    messages = {"content": [{"type": "tool_use", "id": "toolu_1", "name": "bash", "input": {}}]}
    assert inputs.answer_turn("messages", messages, "go")[1]["content"][0]["tool_use_id"] == "toolu_1"


async def test_a_smoke_run_meets_the_targets(tmp_path):
    result = await hostile.bench(hostile.BenchConfig(requests=60, events=10, steps=1), tmp_path, say=lambda m: None)
    assert result["requests"] == 60 and result["events"] == 10 * len(hostile.consumed(cells=1))
    assert result["answered_5xx"] == 0 and result["unanswered"] == 0 and result["crashes"] == 0
    assert result["dead_lettered"] == result["events"] and result["good_calls_lost"] == 0
    assert result["good_calls"] > 0 and result["answered_4xx"] > 0 and result["handler_errors"] == 0
