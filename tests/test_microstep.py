"""Packing samples into micro-steps and the binary micro-step format."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from safetensors.numpy import save

from gyre.trajectory.microstep import MicrostepFormatError, Sample, from_bytes, pack, to_bytes
from gyre.trajectory.tree import Trajectory


def traj(execution, n, trained, *, seed=0, leaf="c", role="main", temperature=1.0, version=3):
    """n positions; the last `trained` positions are trained policy tokens."""
    rs = np.random.default_rng(seed)
    mask = np.zeros(n, dtype=bool)
    mask[n - trained:] = True
    return Trajectory(
        execution=execution, leaf=leaf, role=role,
        input_ids=rs.integers(0, 151936, n).astype(np.int32), loss_mask=mask,
        behaviour_logprobs=np.where(mask, -rs.random(n), 0).astype(np.float32),
        versions=np.where(mask, version, -1).astype(np.int32),
        temperatures=np.where(mask, temperature, 1.0).astype(np.float32),
    )


def test_pack_respects_soft_budget_and_never_splits():
    a = Sample("A", 0.5, (traj("A", 5, 2, leaf="a1", seed=1), traj("A", 4, 1, leaf="a2", seed=2)))
    b = Sample("B", -1.0, (traj("B", 12, 3, leaf="b1", seed=3), traj("B", 7, 0, leaf="b-empty", seed=4),
                           traj("B", 3, 3, leaf="b2", seed=5)))
    out = pack([a, b], 10, step=4, first_index=2)
    assert [m.n_tokens for m in out] == [9, 12, 3]  # 12 > budget: alone; the |K| = 0 path is dropped
    assert [m.index for m in out] == [2, 3, 4] and all(m.step == 4 for m in out)
    m0, m1, m2 = out
    assert m0.executions == ("A",) and m0.cu_seqlens.tolist() == [0, 5, 9]
    assert m0.n_e.tolist() == [3, 3] and m0.advantages.tolist() == [0.5, 0.5]
    # B's trajectories land in two micro-steps; each carries the whole step's N_B = 6.
    assert m1.n_e.tolist() == [6] and m2.n_e.tolist() == [6]
    assert m2.leaves == ("b2",) and m2.advantages.tolist() == [-1.0]
    assert m1.execution_summary() == [("B", 6, -1.0)]
    assert m0.seq_index().tolist() == [0] * 5 + [1] * 4
    with pytest.raises(ValueError):
        pack([a], 0)


def test_pack_counts_a_shared_prefix_once():
    """Trajectories of one execution share a system prompt; the trainer runs it once, so the
    budget counts it once: 3 paths of 1,000 positions sharing 800 cost 1,000 + 2 · 200."""
    prompt = np.arange(800, dtype=np.int32)

    def path(k, seed):
        t = traj("A", 1000, 50, seed=seed, leaf=f"a{k}")
        return dataclasses.replace(t, input_ids=np.concatenate([prompt, t.input_ids[800:]]))

    paths = tuple(path(k, 10 + k) for k in range(3))
    (one,) = pack([Sample("A", 1.0, paths)], 1400)
    assert one.n_trajectories == 3 and one.n_tokens == 3000  # stored whole; run once by the trainer
    assert [m.n_trajectories for m in pack([Sample("A", 1.0, paths)], 1399)] == [2, 1]
    assert [m.n_trajectories for m in pack([Sample("A", 1.0, paths)], 1400, shared_min_tokens=0)] == [1, 1, 1]
    # A prefix shorter than the trainer's sharing minimum is recomputed, so it counts in full.
    assert [m.n_trajectories for m in pack([Sample("A", 1.0, paths)], 1400, shared_min_tokens=801)] == [1, 1, 1]
    # Unrelated trajectories still count in full.
    other = Sample("B", 1.0, (traj("B", 1000, 50, seed=99),))
    assert [m.n_trajectories for m in pack([Sample("A", 1.0, paths[:1]), other], 1999)] == [1, 1]


def test_pack_mixes_executions_in_one_microstep():
    out = pack([Sample("A", 1.0, (traj("A", 4, 2),)), Sample("B", -1.0, (traj("B", 4, 1),))], 100)
    (m,) = out
    assert m.executions == ("A", "B") and m.traj_execution.tolist() == [0, 1]
    assert m.n_e.tolist() == [2, 1] and m.n_trained == 3 and m.n_trajectories == 2


def _assert_same(a, b):
    assert (a.step, a.index, a.executions, a.roles, a.leaves) == (b.step, b.index, b.executions, b.roles, b.leaves)
    for name in ("input_ids", "cu_seqlens", "loss_mask", "behaviour_logprobs", "temperatures", "versions",
                 "traj_execution", "advantages", "n_e"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype, name
        assert np.array_equal(x, y), name


def test_round_trip():
    samples = [
        Sample("s0-g0-e0", 1.25, (traj("s0-g0-e0", 50, 20, seed=1, temperature=0.7, leaf="x:1"),
                                  traj("s0-g0-e0", 31, 5, seed=2, role="sub-agent", leaf="x:4", version=2))),
        Sample("s0-g0-e1", -0.5, (traj("s0-g0-e1", 17, 17, seed=3, leaf="y:0"),)),
    ]
    (m,) = pack(samples, 1000, step=7, first_index=1)
    back = from_bytes(to_bytes(m))
    _assert_same(m, back)
    assert back.input_ids.dtype == np.int32 and back.loss_mask.dtype == bool
    assert back.behaviour_logprobs.dtype == np.float32 and back.versions.dtype == np.int32


def test_round_trip_without_loss_positions():
    t = traj("e", 6, 0)
    m = pack([Sample("e", 1.0, (traj("e", 6, 1),))], 10)[0]
    empty = type(m)(**{**{f: getattr(m, f) for f in m.__dataclass_fields__}, "loss_mask": np.zeros(6, bool),
                       "behaviour_logprobs": np.zeros(6, np.float32), "versions": t.versions})
    _assert_same(empty, from_bytes(to_bytes(empty)))


def test_size_is_a_few_bytes_per_token():
    rs = np.random.default_rng(0)
    trajs = []
    for i in range(8):
        n = 2500
        t = traj("e", n, 0, seed=i)
        mask = rs.random(n) < 0.3  # scattered completions
        versions = np.where(mask, 5, -1).astype(np.int32)
        trajs.append(Trajectory(execution="e", leaf=f"l{i}", role="main", input_ids=t.input_ids, loss_mask=mask,
                                behaviour_logprobs=np.where(mask, -rs.random(n), 0).astype(np.float32),
                                versions=versions, temperatures=np.where(mask, 0.8, 1.0).astype(np.float32)))
    (m,) = pack([Sample("e", 0.3, tuple(trajs))], 1 << 20)
    blob = to_bytes(m)
    per_token = len(blob) / m.n_tokens
    assert 4.0 <= per_token <= 13.0, per_token
    # All trained: ids (4) + log-prob (4) + mask bit, runs small → still within bounds.
    (full,) = pack([Sample("e", 0.3, (traj("e", 20000, 19990),))], 1 << 20)
    assert 4.0 <= len(to_bytes(full)) / full.n_tokens <= 13.0


def test_malformed_blobs_raise():
    with pytest.raises(MicrostepFormatError):
        from_bytes(b"nope")
    with pytest.raises(MicrostepFormatError):
        from_bytes(save({"x": np.zeros(3, np.int32)}, metadata={"format": "other"}))
    with pytest.raises(MicrostepFormatError):
        from_bytes(save({"x": np.zeros(3, np.int32)}, metadata={"format": "gyre.trajectory.microstep.v1", "step": "0",
                                                                 "index": "0", "executions": "[]"}))
