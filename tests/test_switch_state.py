"""A switch frees the state of the role it leaves, measured (DESIGN.md "Cells and engines"), with
real cell processes on a real nats-server (tests/replicas.py: the test plays the builder and
the scheduler).

The cells report on `cell.switched` their live tensor storage before and after each switch,
what the release freed and the snapshot bytes pulled (`bytes`); the test holds those to the
sizes of the tiny model (P parameters: the engine's float32 weights are 4P bytes, the
trainer's float64 weights 8P, its AdamW moments 16P) and of the KV caches the engines kept.
Along the way: a satellite that switches in during step 0 commits micro-steps of step 0; the
core leaves training in the middle of step 1 (its gradient in flight goes to disk with the
rest of its state) and applies the step while in rollout, and the weights and moments still
equal one replica's; a cell back in rollout serves only once it loaded the newest version,
and its calls carry that version, with the log-probs of that checkpoint.
"""
from __future__ import annotations

import datetime as dt

import aiohttp
import numpy as np
import pytest

import schemas
from tests.replicas import Cells, check_moments, check_weights, microsteps, reference, write_model

TOKEN = "replicas-test-engine-token"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("switch-model"))


def sizes(model_dir) -> tuple[int, int]:
    """(P, KV bytes per cached position) of the tiny model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_dir)
    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())
    return params, cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 4  # float32 K and V


async def generate(url: str, ids: list[int], execution: str = "", max_new: int = 6,
                   kv_from: dict | None = None) -> tuple[int, dict]:
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": max_new},
            "return_logprob": True, "gyre_execution": execution or None}
    if kv_from is not None:
        body["gyre_kv_from"] = kv_from
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/generate", json=body, headers={"Authorization": f"Bearer {TOKEN}"}) as r:
            return r.status, await r.json(content_type=None)


def engine_answer(checkpoint, ids: list[int], max_new: int = 6):
    """What an engine freshly built on `checkpoint` answers (greedy)."""
    from gyre.serving.engine import Engine, EngineConfig, GenerateRequest, SamplingParams

    engine = Engine(EngineConfig(model_dir=str(checkpoint)))
    return engine.generate(GenerateRequest(rid="ref", input_ids=tuple(ids),
                                           sampling=SamplingParams(temperature=0, max_new_tokens=max_new)))


def switched(cells: Cells, cell: str, to_role: str) -> schemas.CellSwitched:
    """The newest `cell.switched` of `cell` into `to_role` (its announcement at start included)."""
    return cells.of("cell.switched", cell=cell, to_role=to_role)[-1]


def at(event) -> dt.datetime:
    return dt.datetime.fromisoformat(event.emitted_at.replace("Z", "+00:00"))


async def serves(cells: Cells, cell: str, version: int, checkpoint) -> None:
    """The cell's engine answers with `version` and the log-probs of `checkpoint` (or of the
    initial model when None)."""
    url = switched(cells, cell, "rollout").engine_url
    ids = list(range(3, 33))
    status, got = await generate(url, ids)
    assert status == 200, got
    want = engine_answer(checkpoint or cells.model_dir, ids)
    assert got["meta_info"]["weight_version"] == str(version)
    assert got["output_ids"] == list(want.output_ids)
    np.testing.assert_allclose([lp for lp, _, _ in got["meta_info"]["output_token_logprobs"]], want.logprobs,
                               rtol=0, atol=1e-6)


async def test_switches_free_the_role_left_and_a_returning_engine_serves_the_newest_version(
        nats_server, run_id, tmp_path, model_dir):
    P, kv_per_position = sizes(model_dir)
    engine_w, trainer_w = 4 * P, 8 * P
    steps = [microsteps(0, 12, seed=11), microsteps(1, 8, seed=12)]
    async with Cells(nats_server, run_id, tmp_path, model_dir, device_time_s=0.4, lease_s=10.0) as cells:
        cells.start("cell0")
        cells.start("cell1")
        await cells.until(lambda: {"cell0", "cell1"} <= set(cells.roles), "both cells to announce rollout")
        # Each engine keeps the prefix KV of one execution: 40 prompt ids + 5 fed completion ids.
        for cell in ("cell0", "cell1"):
            status, _ = await generate(switched(cells, cell, "rollout").engine_url, list(range(40)), f"x-{cell}")
            assert status == 200
        kv = 45 * kv_per_position

        # rollout -> training, the core: the engine's weights and KV go, the trainer comes back.
        await cells.switch("cell0", "training")
        core_in = switched(cells, "cell0", "training").bytes
        assert core_in["freed"] >= engine_w + kv, (core_in, engine_w, kv)
        assert trainer_w <= core_in["live_after"] < trainer_w + engine_w, core_in  # the trainer, no engine
        status, body = await generate(switched(cells, "cell0", "rollout").engine_url, [1, 2, 3])
        assert status == 503, body

        # Step 0: the core trains alone, then the satellite switches in while the step is in flight.
        await cells.publish(steps[0])
        await cells.until(lambda: len(cells.of("microstep.committed", 0, replica="cell0")) >= 2,
                          "the core to commit two micro-steps of step 0")
        assert not cells.completed(0)
        await cells.switch("cell1", "training")
        sat_in = switched(cells, "cell1", "training")
        assert sat_in.bytes["freed"] >= engine_w + kv, (sat_in.bytes, engine_w, kv)
        assert sat_in.bytes["pulled_weights"] == trainer_w  # the step's v0 snapshot, float64
        assert trainer_w <= sat_in.bytes["live_after"] < trainer_w + engine_w, sat_in.bytes
        await cells.seal(0, len(steps[0]))
        await cells.until(lambda: cells.completed(0), "step 0")
        await cells.settled_commits(0, 0, len(steps[0]))
        assert cells.of("microstep.committed", 0, replica="cell1"), \
            "the satellite that switched in mid-step committed micro-steps of that step"
        first = min(at(c) for c in cells.of("microstep.committed", 0, replica="cell0"))
        assert all(at(g) > first for g in cells.of("microstep.granted", 0, replica="cell1"))  # it joined mid-step
        assert cells.of("weights.loaded", cell="cell1", policy_version=0, role="training")

        # Step 1: the core leaves training with its gradient in flight, and applies the step in rollout.
        await cells.publish(steps[1])
        await cells.until(lambda: len(cells.of("microstep.committed", 1, replica="cell0")) >= 2,
                          "the core to commit two micro-steps of step 1")
        await cells.switch("cell0", "rollout")
        core_out = switched(cells, "cell0", "rollout")
        # weights (8P), AdamW's two moments after step 0 (16P) and the step's gradient (8P) are freed
        assert core_out.bytes["freed"] >= 4 * trainer_w, (core_out.bytes, trainer_w)
        assert engine_w <= core_out.bytes["live_after"] < engine_w + trainer_w, core_out.bytes
        assert core_out.policy_version == 1 and core_out.bytes["pulled_weights"] == trainer_w
        await serves(cells, "cell0", 1, cells.checkpoint(1))
        await cells.seal(1, len(steps[1]))
        await cells.until(lambda: cells.completed(1), "step 1, applied by the core in rollout")

        # The satellite comes back: it serves v2 only once loaded, and its calls carry v2.
        await cells.switch("cell1", "rollout")
        sat_out = switched(cells, "cell1", "rollout")
        assert sat_out.bytes["freed"] >= trainer_w, sat_out.bytes
        assert engine_w <= sat_out.bytes["live_after"] < engine_w + trainer_w, sat_out.bytes
        assert sat_out.policy_version == 2 and sat_out.bytes["pulled_weights"] == trainer_w
        (loaded,) = cells.of("weights.loaded", cell="cell1", policy_version=2, role="rollout")
        assert at(loaded) < at(sat_out)
        await serves(cells, "cell1", 2, cells.checkpoint(2))
        print("bytes", {(c, r): switched(cells, c, r).bytes for c in ("cell0", "cell1") for r in ("training", "rollout")},
              "P", P)

        for step, mss in enumerate(steps):
            assert await cells.settled_commits(step, 0, len(mss)) == {i: 1 for i in range(len(mss))}
    expected = reference(model_dir, cells.recipe, steps)
    check_weights(cells.checkpoint(2), expected)
    check_moments(cells.checkpoint(2), expected)


async def test_a_cell_hosting_the_scripted_engine_answers_through_its_url_and_stops_while_training(
        nats_server, run_id, tmp_path, model_dir):
    script = tmp_path / "script.jsonl"
    script.write_text('"hello from the script"\n')
    async with Cells(nats_server, run_id, tmp_path, model_dir) as cells:
        cells.recipe.write_text(cells.recipe.read_text() + f'\n[engine]\nkind = "scripted"\nscript = "{script}"\n')
        cells.start("cell0")
        await cells.until(lambda: "cell0" in cells.roles, "cell0 to announce itself")
        url = switched(cells, "cell0", "rollout").engine_url
        status, body = await generate(url, [1, 2, 3], "x")
        assert status == 200 and body["text"] == "hello from the script", body
        assert body["meta_info"]["weight_version"] == "0"
        # a moved execution's KV hint: the scripted host keeps no KV, so it answers at once
        status, body = await generate(url, [1, 2, 3, 4], "x", kv_from={"cell": "cell1", "route": 0})
        assert status == 200 and body["text"] == "hello from the script", body
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{url}/get_model_info", headers={"Authorization": f"Bearer {TOKEN}"}) as r:
                counters = (await r.json())["counters"]
        assert counters == {"prefill_tokens": 7, "kv_imported_tokens": 0, "kv_dropped": 0}, counters
        await cells.switch("cell0", "training")
        assert (await generate(url, [1, 2, 3]))[0] == 503
        await cells.switch("cell0", "rollout")
        status, body = await generate(url, [1, 2, 3])
        assert status == 200 and body["text"] == "hello from the script", body
