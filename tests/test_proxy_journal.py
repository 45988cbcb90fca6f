"""The proxy's call journal (handlers/proxy/journal.py): what a proxy killed before
JetStream acknowledged its answered calls leaves to its successor, and what it costs to
keep it small. The kill itself, with a real proxy process: tests/test_crash_proxy.py (slow)."""
from __future__ import annotations

import asyncio

import orjson
import pytest

import schemas
from bus import Bus
from gyre.serving.tokenizer import build_tokenizer
from handlers.proxy import journal, restart
from handlers.proxy.daemon import Config
from handlers.proxy.outbox import Outgoing
from handlers.proxy.state import ProxyState
from schemas import ids

SECRET = b"journal-test-secret"


def _event(run: str, execution: str, seq: int, status: str = "ok") -> schemas.CallCompleted:
    return schemas.CallCompleted(event_id=ids.call(run, execution, seq), call=f"{execution}:{seq}",
                                 execution=execution, seq=seq, parent_call=None, prefix_len=0,
                                 tokens=schemas.CallTokens(prompt_ids=(1, 2, 3), completion_ids=(4, 5),
                                                           logprobs=(-0.5, -0.25)),
                                 sampling=schemas.SamplingParams(), finish_reason="stop", versions=((0, 2, 0),),
                                 cell="c", role="main", api="chat", status=status, timings={}, drift=0, meta={})


def _line(event: schemas.CallCompleted) -> bytes:
    return orjson.dumps({"event": orjson.Fragment(schemas.encode(event)), "tokens": None})


def test_a_segment_is_removed_once_its_calls_are_acknowledged_and_the_rest_survive_a_kill(tmp_path):
    prefix = tmp_path / "proxy-journal"
    j = journal.Journal(prefix, segment_bytes=1)  # a new segment for every call
    events = [_event("r", "e", s) for s in range(3)]
    for e in events:
        j.write(e.event_id, _line(e))
    assert len(journal.segments(prefix)) == 3
    j.done(events[0].event_id)  # a closed segment with nothing pending goes at once
    assert [p.name for p in journal.segments(prefix)] == ["proxy-journal.1.jsonl", "proxy-journal.2.jsonl"]
    j.done(events[2].event_id)  # the current one stays open until the next rotation or close
    assert j.pending() == 1
    # A kill now (no close): what is left is read back, the acknowledged call with it only
    # while its segment is the current one (republishing skips the stored ids).
    items, paths = journal.read(prefix)
    assert {i["event"]["call"] for i in items} == {"e:1", "e:2"} and len(paths) == 2
    j.close()  # a clean stop: segments with nothing pending are removed
    assert [p.name for p in journal.segments(prefix)] == ["proxy-journal.1.jsonl"]
    assert journal.Journal(prefix)._n == 2  # a successor numbers on after what is left


def test_the_last_line_of_a_call_counts_and_a_line_cut_by_a_kill_is_skipped(tmp_path):
    prefix = tmp_path / "j"
    j = journal.Journal(prefix)
    j.write("r:e:call:0", _line(_event("r", "e", 0)))
    j.write("r:f:call:0", _line(_event("r", "f", 0)))
    j.write("r:e:call:0", _line(_event("r", "e", 0, status="aborted")))  # its delivery was cut after all
    with open(journal.segments(prefix)[-1], "ab") as f:
        f.write(_line(_event("r", "g", 0))[:40])  # a write the kill cut short
    items, _ = journal.read(prefix)
    assert [(i["event"]["call"], i["event"]["status"]) for i in items] == [("e:0", "aborted"), ("f:0", "ok")]


@pytest.mark.parametrize("journaled", [True, False])
async def test_a_successor_publishes_the_calls_a_killed_proxy_answered_and_numbers_after_them(
        tmp_path, nats_server, run_id, journaled):
    """A proxy answered three calls (journaled before each answer) and was killed before the
    bus had two of them; its successor publishes those two before serving, not the stored
    one again, and continues the execution's seqs after them. Without a journal the two are lost."""
    tok = build_tokenizer()
    bus = await Bus.connect(nats_server.url, token=nats_server.token, run=run_id, name="test")
    await bus.ensure_streams()
    cfg = Config(run=run_id, key_secret=SECRET, spill_file=str(tmp_path / "spill.jsonl"),
                 journal=str(tmp_path / "proxy-journal") if journaled else "")
    try:
        killed = ProxyState(cfg, tok, session=None, bus=bus)
        outs = [killed.journaled(Outgoing(_event(run_id, "ex", s))) for s in range(3)]
        assert (len(killed._journaled) == 3) == journaled
        await killed.publish(outs[0])  # acknowledged: it leaves the journal
        assert killed.journal is None or killed.journal.pending() == 2
        # killed here: outs[1] and outs[2] were answered, never published, never spilled

        successor = ProxyState(cfg, tok, session=None, bus=bus)
        assert await restart.resume(successor, bus, asyncio.Event())
        stored = sorted(e.call for e in await bus.stored_events(["call.completed"]))
        if not journaled:
            assert stored == ["ex:0"]  # the window the journal closes
            return
        assert stored == ["ex:0", "ex:1", "ex:2"]
        assert journal.segments(tmp_path / "proxy-journal") == []
        assert successor.executions["ex"].next_seq == 3
    finally:
        await bus.close()
