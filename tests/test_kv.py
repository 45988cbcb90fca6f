"""KV blocks between two embedded engines (DESIGN.md "Cells and engines"): the exporting
engine's prefix KV cache moves through the transfer layer, and the importing engine's next
call for that execution prefills only the new ids, with the exporting engine's log-probs.
And `handlers.transfer.kv_move.KvMoves` between two cells in one process: what is offered,
dropped, freed, and how long a moved execution's request is held (tests/test_kv_move.py runs
it on cell processes through the proxy)."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

import schemas
from gyre.serving.engine import Engine, EngineConfig, GenerateRequest, SamplingParams
from gyre.serving.kv import KvFormatError, from_snapshot, to_snapshot
from handlers.transfer.kv_move import KvMoves
from handlers.transfer.loopback import LoopbackTransfer
from tests.test_engine import build_tiny_model, prompt

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("kv") / "m", seed=3)


@pytest.fixture
def transfer():
    owner, reader = LoopbackTransfer(lease_s=5.0), LoopbackTransfer(lease_s=5.0)
    yield owner, reader
    owner.close()
    reader.close()


def _first_and_next(engine: Engine):
    """Serve the execution's first call; return the prompt of its next call (history + new ids)."""
    first = prompt(150, seed=1)
    res = engine.generate(GenerateRequest(rid="c1", input_ids=first, sampling=GREEDY, execution="ex"))
    return first + res.output_ids + prompt(9, seed=2)


def test_imported_blocks_prefill_only_the_new_tokens_with_the_exporters_logprobs(model_dir, transfer):
    owner, reader = transfer
    a, b = Engine(EngineConfig(model_dir=model_dir)), Engine(EngineConfig(model_dir=model_dir))
    nxt = _first_and_next(a)
    blocks = a.export_kv("ex", block_tokens=32)
    assert blocks is not None and blocks.version == 0 and len(blocks.ids) == 155  # 150 prompt + 5 fed outputs
    ref = owner.expose("kv-ex", to_snapshot(blocks))
    got = from_snapshot(reader.pull(ref, "cell1"))  # verified against the manifest
    assert got.ids == blocks.ids and got.version == 0

    assert b.import_kv("ex", got)
    before = b.prefilled_tokens
    res_b = b.generate(GenerateRequest(rid="c2", input_ids=nxt, sampling=GREEDY, execution="ex"))
    assert res_b.cached_tokens == len(blocks.ids)
    assert b.prefilled_tokens - before == len(nxt) - len(blocks.ids)  # only the new ids

    res_a = a.generate(GenerateRequest(rid="c2", input_ids=nxt, sampling=GREEDY, execution="ex"))
    assert res_b.output_ids == res_a.output_ids
    np.testing.assert_allclose(res_b.logprobs, res_a.logprobs, atol=1e-5)

    # a block perturbed on purpose changes the log-probs: the import is really used
    c = Engine(EngineConfig(model_dir=model_dir))
    bent = to_snapshot(blocks)
    bent["kv.1.v.2"] = bent["kv.1.v.2"] + 0.5
    assert c.import_kv("ex", from_snapshot(bent))
    res_c = c.generate(GenerateRequest(rid="c2", input_ids=nxt, sampling=GREEDY, execution="ex"))
    assert res_c.cached_tokens == len(blocks.ids)
    assert np.max(np.abs(np.asarray(res_c.logprobs) - np.asarray(res_a.logprobs))) > 1e-3


def test_a_retried_call_on_imported_blocks_gets_the_bits_of_a_fresh_call(model_dir, transfer):
    """A call cut at the cell leaving rollout and retried where its execution's KV moved
    (every prompt id but the last from the imported blocks) samples the same tokens with
    the same log-probs, to the bit, as the call on a fresh engine: the prompt's last id
    always runs alone, so its logits never depend on whether the ids before it were
    prefilled in this call or elsewhere, and which cell served a call does not show in
    what it sampled (`make demo`'s reward curve, elastic on two cells)."""
    owner, reader = transfer
    a, b, fresh = (Engine(EngineConfig(model_dir=model_dir)) for _ in range(3))
    p = prompt(53, seed=4)
    sp = SamplingParams(temperature=1.0, max_new_tokens=6, seed=11, ignore_eos=True)
    a.generate(GenerateRequest(rid="x:0", input_ids=p, sampling=sp, execution="ex"))  # at the leaving cell
    blocks = a.export_kv("ex", block_tokens=32)
    assert b.import_kv("ex", from_snapshot(reader.pull(owner.expose("kv-ex", to_snapshot(blocks)), "cell1")))
    moved = b.generate(GenerateRequest(rid="x:1", input_ids=p, sampling=sp, execution="ex"))
    ref = fresh.generate(GenerateRequest(rid="x:0", input_ids=p, sampling=sp, execution="ex"))
    assert (moved.cached_tokens, ref.cached_tokens) == (len(p) - 1, 0)
    assert moved.output_ids == ref.output_ids
    assert moved.logprobs == ref.logprobs  # bit for bit, not within a tolerance


def test_blocks_of_another_version_are_dropped_counted_and_the_prefix_recomputed(model_dir):
    a, b = Engine(EngineConfig(model_dir=model_dir)), Engine(EngineConfig(model_dir=model_dir, initial_version=1))
    nxt = _first_and_next(a)
    blocks = a.export_kv("ex")
    assert not b.import_kv("ex", blocks)
    assert b.kv_dropped == 1
    res = b.generate(GenerateRequest(rid="c2", input_ids=nxt, sampling=GREEDY, execution="ex"))
    assert res.cached_tokens == 0 and b.prefilled_tokens == len(nxt)


def test_malformed_blocks_are_refused(model_dir):
    a = Engine(EngineConfig(model_dir=model_dir))
    _first_and_next(a)
    snap = to_snapshot(a.export_kv("ex", block_tokens=64))
    del snap["kv.0.k.1"]
    with pytest.raises(KvFormatError, match="layer 0 k"):
        from_snapshot(snap)
    with pytest.raises(KvFormatError):
        from_snapshot({"kv.ids": np.arange(3)})


class _Cells:
    """Two cells' `KvMoves` in one process, their events delivered to both as the bus would."""

    def __init__(self, a: Engine, b: Engine, transfer, **kw):
        self.events: list = []
        self.a = KvMoves(run="r", cell="a", engine=a, transfer=transfer[0], publish=self.deliver,
                         serving=lambda: True, **kw)
        self.b = KvMoves(run="r", cell="b", engine=b, transfer=transfer[1], publish=self.deliver,
                         serving=lambda: True, **kw)
        self.reach = [self.a, self.b]
        for m in self.reach:
            m.caught_up.set()

    async def deliver(self, event) -> None:
        self.events.append(event)
        for m in self.reach:
            await m.handle(event)


def _switch(*routes: tuple[str, str]) -> schemas.CellSwitch:
    return schemas.CellSwitch(event_id="r:cell:a:switch:0", cell="a", seq=0, from_role="rollout", to_role="training",
                              reason="test", moved=tuple(schemas.Route(execution=e, cell=c) for e, c in routes),
                              route_seq=4)


async def test_a_moved_block_of_another_version_is_pulled_dropped_and_its_request_let_go(model_dir, transfer):
    a, b = Engine(EngineConfig(model_dir=model_dir)), Engine(EngineConfig(model_dir=model_dir, initial_version=1))
    _first_and_next(a)  # "ex" has a prefix at a
    cells = _Cells(a, b, transfer, hold_s=0.5, confirm_s=5.0)
    held = asyncio.create_task(cells.b.hold("ex", "a", 4))  # its request came first
    pulled = await cells.a.offer(_switch(("ex", "b"), ("paused", ""), ("none-kept", "b")))
    (offer,) = [e for e in cells.events if isinstance(e, schemas.KvOffered)]
    (answer,) = [e for e in cells.events if isinstance(e, schemas.KvPulled)]
    assert [(x.execution, x.to_cell, x.policy_version) for x in offer.blocks] == [("ex", "b", 0)]
    assert pulled == answer.bytes == offer.blocks[0].bytes > 0  # pulled and verified, then dropped
    assert answer.tokens == 0 and "policy version 0" in answer.error
    assert b.counters() == {"prefill_tokens": 0, "kv_imported_tokens": 0, "kv_dropped": 1}
    await asyncio.wait_for(held, 1.0)
    for _ in range(100):  # withdrawn once answered; freed as the reader's lease ends (its verdict byte)
        if transfer[0].exposed() == []:
            break
        await asyncio.sleep(0.02)
    assert transfer[0].exposed() == []
    t0 = asyncio.get_running_loop().time()
    await cells.b.hold("none-kept", "a", 4)  # not in the offer: at once
    await cells.b.hold("ex", "a", 5)  # an offer that never comes: the bound
    assert 0.45 < asyncio.get_running_loop().time() - t0 < 2.0


async def test_blocks_nobody_answers_for_are_freed_after_confirm_s(model_dir, transfer):
    a = Engine(EngineConfig(model_dir=model_dir))
    _first_and_next(a)
    cells = _Cells(a, a, transfer, confirm_s=0.3)
    cells.reach = [cells.a]  # cell b is gone
    t0 = asyncio.get_running_loop().time()
    assert await cells.a.offer(_switch(("ex", "b"))) == 0
    assert asyncio.get_running_loop().time() - t0 >= 0.3  # it waited for an answer, then gave up
    assert transfer[0].exposed() == []
    assert a.export_kv("ex") is not None  # the engine's own copy goes with the switch's release_engine


async def test_an_offer_without_blocks_still_tells_the_new_cell_nothing_comes(model_dir, transfer):
    a = Engine(EngineConfig(model_dir=model_dir))
    cells = _Cells(a, a, transfer, hold_s=5.0, confirm_s=5.0)
    held = asyncio.create_task(cells.b.hold("never-served", "a", 4))
    t0 = asyncio.get_running_loop().time()
    assert await cells.a.offer(_switch(("never-served", "b"))) == 0  # no prefix kept: nothing to wait for
    await asyncio.wait_for(held, 1.0)
    assert asyncio.get_running_loop().time() - t0 < 1.0
    (offer,) = cells.events
    assert isinstance(offer, schemas.KvOffered) and offer.blocks == () and offer.route_seq == 4
