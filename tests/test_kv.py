"""KV blocks between two embedded engines (DESIGN.md "Cells and engines"): the exporting
engine's prefix KV cache moves through the transfer layer, and the importing engine's next
call for that execution prefills only the new ids, with the exporting engine's log-probs."""
from __future__ import annotations

import numpy as np
import pytest

from gyre.serving.engine import Engine, EngineConfig, GenerateRequest, SamplingParams
from gyre.serving.kv import KvFormatError, from_snapshot, to_snapshot
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
