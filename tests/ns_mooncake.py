"""Weight publication over Mooncake, run inside a private network namespace.

tests/test_mooncake.py runs this module with pytest inside `unshare -n` (lo up;
tests/namespace.py): the nats-server, the cell processes and Mooncake's engines all live in
that namespace. Outside one these tests refuse to run (Mooncake would bind every interface).
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import aiohttp
import numpy as np
import orjson
import pytest

import schemas
from bus import Bus
from gyre.serving.engine import Engine, EngineConfig, GenerateRequest, SamplingParams
from gyre.transfer.interface import TransferError, TransferRef
from handlers.transfer.follow import EngineWeights
from handlers.transfer.mooncake import MooncakeTransfer, private_namespace
from schemas import ids
from tests.replicas import ROOT, Cells, microsteps, write_model
from tests.transfer_peer import seeded, slow

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


# -- fault tests: an owner process, readers here ------------------------------------------------
class Peer:
    """A `tests.transfer_peer` owner process (its module docstring lists the ops)."""

    def __init__(self, lease_s: float = 2.0, keepalive_s: float = 2.0) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.transfer_peer", "owner", str(lease_s),
                                      str(keepalive_s)], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert orjson.loads(self.proc.stdout.readline())["ready"]

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(orjson.dumps(cmd).decode() + "\n")
        self.proc.stdin.flush()
        out = orjson.loads(self.proc.stdout.readline())
        return out

    def ref(self, **cmd) -> TransferRef:
        out = self.ask(**cmd)
        assert "key" in out, out
        return TransferRef(out["key"], out["digest"])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def peer():
    p = Peer()
    yield p
    p.close()


@pytest.fixture
def reader():
    t = MooncakeTransfer(slice_bytes=1 << 20, timeout_s=10.0, keepalive_s=2.0)
    yield t
    t.close()


def within(seconds: float, fn, *args):
    """fn(*args) in a thread; its result or exception, or AssertionError if it runs past `seconds` (a hang)."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{fn.__name__} still running after {seconds} s: it hangs"
    if "error" in box:
        raise box["error"]
    return box["value"]


@pytest.fixture
async def follower(nats_server, run_id, reader, model_dir):
    bus = await Bus.connect(nats_server.url, token=nats_server.token, run=run_id, name="test")
    await bus.ensure_streams()
    engine = Engine(EngineConfig(model_dir=str(model_dir)))
    weights = EngineWeights(run=run_id, cell="cell1", engine=engine, transfer=reader, publish=bus.publish,
                            serving=lambda: True, attempts=1)
    weights.bus = bus
    yield weights
    weights.stop()
    await bus.close()


def published(run: str, ref: TransferRef, version: int) -> schemas.WeightsPublished:
    return schemas.WeightsPublished(event_id=ids.weights(run, version, 0), policy_version=version, step=version - 1,
                                    path="", epoch=0, key=ref.key, digest=ref.digest)


async def _refused(follower: EngineWeights, ref: TransferRef, *, cancel=None) -> str:
    """Load `ref` as v1 and check it was refused: nothing published, the engine serves v0."""
    ok = await follower.load(published(follower.run, ref, 1), cancel=cancel)
    assert not ok and follower.engine.version == 0
    assert await follower.bus.stored_ids("weights.loaded") == {}
    res = follower.engine.generate(GenerateRequest(rid="after", input_ids=(5, 6, 7),
                                                   sampling=SamplingParams(max_new_tokens=3, ignore_eos=True)))
    assert res.versions == ((0, 3, 0),)  # the old version keeps serving
    return follower.refused[-1][1]


@pytest.mark.parametrize("how", ["zeros", "short"])
async def test_no_bytes_or_truncated_bytes_moved_are_refused(peer, follower, model_dir, how):
    ref = peer.ref(op="expose_model", name="weights-v1-e0", model_dir=str(model_dir), delta=0.01)
    assert peer.ask(op="sabotage", name="weights-v1-e0", how=how) == {"ok": True}
    error = await _refused(follower, ref)
    if how == "zeros":  # the bytes read were not the snapshot's: the first tensor's checksum fails
        assert "checksum" in error and ("tensor 'lm_head.weight'" in error or "tensor 'model." in error), error
    else:
        assert "tensors not received" in error and "'model." in error, error


async def test_corrupted_tensor_is_refused(peer, follower, model_dir):
    ref = peer.ref(op="expose_model", name="weights-v1-e0", model_dir=str(model_dir), delta=0.01)
    peer.ask(op="sabotage", name="weights-v1-e0", how="flip")
    error = await _refused(follower, ref)
    assert "checksum" in error, error


async def test_timed_out_or_cancelled_transfers_are_refused_never_success(peer, follower, model_dir):
    ref = peer.ref(op="expose_model", name="weights-v1-e0", model_dir=str(model_dir), delta=0.01)
    follower.transfer.slice_bytes = 4 << 10  # many slices
    slow(follower.transfer, 0.05)
    follower.transfer.timeout_s = 0.3
    assert "timed out" in await _refused(follower, ref)
    follower.transfer.timeout_s = 30.0
    cancel = threading.Event()
    threading.Timer(0.3, cancel.set).start()
    assert "cancelled" in await _refused(follower, ref, cancel=cancel)
    follower.transfer._engine.delay_s = 0.0
    assert await follower.load(published(follower.run, ref, 1))  # the same snapshot, whole: loaded
    assert follower.engine.version == 1 and len(await follower.bus.stored_ids("weights.loaded")) == 1
    # the refused pulls left nothing behind: the engine holds exactly the published weights
    from safetensors.numpy import load_file

    live = follower.engine.model.state_dict()
    for name, value in load_file(f"{model_dir}/model.safetensors").items():
        np.testing.assert_array_equal(live[name].numpy(), value + np.float32(0.01), err_msg=name)


async def test_killed_mid_pull_a_reader_keeps_the_snapshot_until_the_others_finish_then_its_lease_ends(peer, reader):
    v1 = peer.ref(op="expose", name="w-v1", seed=1, mib=24)
    killed = subprocess.Popen([sys.executable, "-m", "tests.transfer_peer", "reader", v1.key, v1.digest, "0.05", "killed"],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    frozen = subprocess.Popen([sys.executable, "-m", "tests.transfer_peer", "reader", v1.key, v1.digest, "0.05", "frozen"],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    for p in (killed, frozen):
        assert p.stdout.readline().strip() == "started"
    time.sleep(0.5)  # both mid-pull (24 slices at 0.05 s and up)
    killed.kill()
    frozen.send_signal(signal.SIGSTOP)  # holds its lease, renews nothing
    assert peer.ask(op="claims")["claims"] == {"w-v1": ["frozen", "killed"]} or \
        peer.ask(op="claims")["claims"] == {"w-v1": ["frozen"]}  # both mid-pull; the killed one may be gone
    slow(reader, 0.02)
    pulling = threading.Thread(target=lambda: box.append(reader.pull(v1, "steady")))
    box: list = []
    pulling.start()
    time.sleep(0.1)
    peer.ask(op="withdraw", name="w-v1")
    v2 = peer.ref(op="expose", name="w-v2", seed=2, mib=1)  # the next version is not blocked
    assert "w-v1" in peer.ask(op="exposed")["names"]  # held while readers pull it
    pulling.join(30)
    assert box and all(np.array_equal(box[0][k], v) for k, v in seeded(1, 24).items())
    deadline = time.monotonic() + 10
    while "w-v1" in peer.ask(op="exposed")["names"]:  # the frozen reader's lease (2 s) ends
        assert time.monotonic() < deadline, "the withdrawn snapshot was never released"
        time.sleep(0.1)
    assert peer.ask(op="exposed")["names"] == ["w-v2"]
    reader._engine.delay_s = 0.0
    got = reader.pull(v2, "steady")
    assert all(np.array_equal(got[k], v) for k, v in seeded(2, 1).items())
    frozen.send_signal(signal.SIGCONT)
    frozen.kill()
    frozen.wait(10)
    killed.wait(10)


async def test_back_to_back_versions_never_mix_bytes_in_a_slow_readers_pull(peer, reader):
    v1 = peer.ref(op="expose", name="weights-v1-e0", seed=1, mib=8)
    slow(reader, 0.05)
    box: list = []
    pulling = threading.Thread(target=lambda: box.append(reader.pull(v1, "slow")))
    pulling.start()
    time.sleep(0.15)
    v2 = peer.ref(op="expose", name="weights-v2-e0", seed=2, mib=8)  # published while v1 is pulled
    peer.ask(op="withdraw", name="weights-v1-e0")
    again = peer.ask(op="expose", name="weights-v1-e0", seed=3, mib=8)  # a name reused while held
    assert "still held" in again.get("error", ""), again
    pulling.join(30)
    assert box, "the slow pull failed"
    want = seeded(1, 8)
    assert all(np.array_equal(box[0][k], want[k]) for k in want)  # v1's bytes only
    reader._engine.delay_s = 0.0
    got = reader.pull(v2, "slow")
    assert all(np.array_equal(got[k], v) for k, v in seeded(2, 8).items())


async def test_idle_gap_a_transfer_after_a_gap_longer_than_the_keepalive_succeeds_or_fails_loudly(peer, reader):
    ref = peer.ref(op="expose", name="w-v1", seed=1, mib=2)
    within(20, reader.pull, ref, "idle")
    time.sleep(2.5)  # longer than the 2 s keep-alive of both ends
    got = within(20, reader.pull, ref, "idle")
    assert all(np.array_equal(got[k], v) for k, v in seeded(1, 2).items())
    time.sleep(2.5)
    peer.proc.send_signal(signal.SIGSTOP)  # the owner vanishes without closing anything
    reader.timeout_s = 3.0
    try:
        with pytest.raises(TransferError):
            within(30, reader.pull, ref, "idle")  # fails loudly, never hangs
    finally:
        peer.proc.send_signal(signal.SIGCONT)


def test_bench_transfer_measures_the_mooncake_path_and_the_socket_copy(tmp_path):
    """`gyre bench transfer` (small: 8 MiB, one repetition) writes BENCHMARKS.md's keys."""
    from handlers.bench.transfer import main

    out = tmp_path / "transfer.json"
    assert main(["--mib", "8", "--reps", "1", "--json", str(out)]) == 0
    doc = orjson.loads(out.read_bytes())
    g = doc["weights_gb_per_s"]
    assert g["mooncake"] > 0 and g["socket"] > 0 and doc["ratio"] == pytest.approx(g["mooncake"] / g["socket"], rel=1e-2)
    assert doc["verify_s"] > 0 and doc["profile"]["read_s"] > 0 and doc["profile"]["slices"] >= 1
    assert "recv_into" in doc["socket_baseline_code"] and doc["machine"]["cpus"] >= 1


async def test_a_moved_executions_kv_blocks_move_over_mooncake_and_its_next_call_prefills_only_new_ids(tmp_path):
    """handlers.transfer.kv_move over two Mooncake backends (the cells' part of a switch, in
    one process): the block is pulled, verified and imported; the next call reuses it."""
    from tests.test_engine import build_tiny_model
    from tests.test_kv import GREEDY, _Cells, _first_and_next, _switch

    model = build_tiny_model(tmp_path / "m", seed=3)
    a, b = Engine(EngineConfig(model_dir=model)), Engine(EngineConfig(model_dir=model))
    nxt = _first_and_next(a)
    backends = (MooncakeTransfer(), MooncakeTransfer())
    try:
        cells = _Cells(a, b, backends, hold_s=10.0, confirm_s=10.0)
        pulled = await cells.a.offer(_switch(("ex", "b")))
        (answer,) = [e for e in cells.events if isinstance(e, schemas.KvPulled)]
        assert pulled == answer.bytes > 0 and answer.tokens == 155 and answer.error == ""
        res = b.generate(GenerateRequest(rid="c2", input_ids=nxt, sampling=GREEDY, execution="ex"))
        assert res.cached_tokens == 155 and res.prefilled_tokens == len(nxt) - 155
        want = a.generate(GenerateRequest(rid="c2", input_ids=nxt, sampling=GREEDY, execution="ex"))
        np.testing.assert_allclose(res.logprobs, want.logprobs, atol=1e-5)
    finally:
        for t in backends:
            t.close()
