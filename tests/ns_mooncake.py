"""Weight publication over Mooncake, run inside a private network namespace.

tests/test_mooncake.py runs this module with pytest inside `unshare -n` (lo up;
tests/namespace.py): the nats-server, the cell processes and Mooncake's engines all live in
that namespace. Outside one these tests refuse to run (Mooncake would bind every interface).
"""
from __future__ import annotations

import asyncio
import os

import aiohttp
import pytest

from handlers.transfer.mooncake import private_namespace
from tests.replicas import Cells, microsteps, write_model

pytestmark = pytest.mark.skipif(not private_namespace(), reason="runs inside a private network namespace only "
                                "(tests/test_mooncake.py starts it)")

ENGINE_TOKEN = "replicas-test-engine-token"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("mooncake-model"))


async def _generate(session: aiohttp.ClientSession, url: str, max_new_tokens: int) -> dict:
    body = {"input_ids": list(range(3, 40)), "sampling_params": {"temperature": 1.0, "max_new_tokens": max_new_tokens,
                                                                  "ignore_eos": True}, "return_logprob": True}
    async with session.post(f"{url}/generate", json=body,
                            headers={"Authorization": f"Bearer {ENGINE_TOKEN}"}) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def test_the_core_publishes_over_mooncake_and_engines_and_a_satellite_load_verified(
        nats_server, run_id, tmp_path, model_dir):
    """cell0 (the core) and cell2 (a satellite) train step 0, cell1 serves. The satellite
    pulls v0 from the core through Mooncake (verified) and publishes `weights.loaded`
    (training). After the step the core exposes v1 and publishes `weights.published`; cell1's
    engine pulls it, loads it while serving and publishes `weights.loaded`; generations
    running across the load show v0 then v1 in their version spans and complete. cell2 returns
    to rollout and loads v1 the same way. Calls served afterwards carry v1."""
    async with Cells(nats_server, run_id, tmp_path, model_dir, transfer="mooncake", device_time_s=0.1) as cells:
        for cell in ("cell0", "cell1", "cell2"):
            cells.start(cell)
        await cells.switch("cell0", "training")
        await cells.switch("cell2", "training")
        await cells.until(lambda: cells.roles.get("cell1") == "rollout", "cell1 serving")
        url = next(e.engine_url for e in cells.facts["cell.switched"] if e.cell == "cell1" and e.to_role == "rollout")
        spans: list[list] = []
        stop = asyncio.Event()

        async def keep_generating() -> None:
            async with aiohttp.ClientSession() as session:
                while not stop.is_set():
                    out = await _generate(session, url, 60)
                    assert out["meta_info"]["completion_tokens"] == 60  # never dropped
                    spans.append(out["meta_info"]["gyre_versions"])

        load = [asyncio.create_task(keep_generating()) for _ in range(2)]
        await cells.publish(microsteps(0, 4, seed=1))
        await cells.seal(0, 4)
        await cells.until(lambda: cells.completed(0), "step 0")
        await cells.until(lambda: cells.of("weights.loaded", policy_version=1, cell="cell1"), "cell1 to load v1")
        await cells.until(lambda: any(len(s) == 2 for s in spans), "a generation that spans the load", 60)
        stop.set()
        await asyncio.gather(*load)
        await cells.switch("cell2", "rollout")
        await cells.until(lambda: cells.of("weights.loaded", policy_version=1, cell="cell2"), "cell2 to load v1")

        v0, v1 = (cells.of("weights.published", policy_version=v) for v in (0, 1))
        assert v1[0].key.startswith("mooncake://127.0.0.1:") and v1[0].key.endswith("/weights-v1-e0")
        loaded = {(e.cell, e.policy_version, e.role, e.verified, e.digest) for e in cells.facts["weights.loaded"]}
        assert loaded >= {("cell1", 1, "rollout", True, v1[0].digest), ("cell2", 1, "rollout", True, v1[0].digest)}
        assert [e for e in cells.facts["weights.loaded"] if (e.cell, e.policy_version, e.role) == ("cell2", 0, "training")]
        assert sum(1 for e in cells.of("microstep.committed", 0) if e.replica == "cell2") >= 1  # it trained on v0
        across = [s for s in spans if len(s) == 2]
        assert all(s[0][2] == 0 and s[1][2] == 1 and s[0][1] == s[1][0] for s in across), across
        assert not v0 or v0[0].key  # a restarted core republishes v0; the first core does not

        urls = {e.cell: e.engine_url for e in cells.facts["cell.switched"] if e.to_role == "rollout"}
        async with aiohttp.ClientSession() as session:  # served after the load: v1
            for cell in ("cell1", "cell2"):
                out = await _generate(session, urls[cell], 5)
                assert out["meta_info"]["gyre_versions"] == [[0, 5, 1]] and out["meta_info"]["weight_version"] == "1"
        logs = {p.name: p.read_text(errors="replace") for p in (cells.run_dir / "logs").glob("*.log")}
    assert all("transfer.mooncake.started" in text for text in logs.values()), list(logs)
    assert not [name for name, text in logs.items() if "cell.weights.refused" in text]
    assert os.environ.get("GYRE_IN_NAMESPACE") == "1"
