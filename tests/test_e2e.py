"""The whole loop on one machine: harness → proxy → engine → trajectories → GSPO step
→ new weights served, with every daemon a real process on a real nats-server.

Toy verifiable task (gyre/env/data/tasks/toy.jsonl) and toy harness: the harness asks the
tiny model once and writes its answer to answer.txt; hidden tests grade properties of
that file, so rewards differ inside a group even for a random policy. Weight decay 0.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

import schemas
from bus import Bus
from gyre.trajectory.microstep import from_bytes

ROOT = Path(__file__).resolve().parents[1]


async def _collect(server, run: str):
    """Read back every call.completed, micro-step and weights event of the run."""
    bus = await Bus.connect(server.url, token=server.token, run=run, name="e2e-check")
    calls, microsteps, weights = [], [], []
    stop = asyncio.Event()
    caught = asyncio.Event()

    async def on(event):
        if isinstance(event, schemas.CallCompleted):
            calls.append(event)
        elif isinstance(event, schemas.WeightsPublished):
            weights.append(event)

    task = asyncio.create_task(bus.replay(["call.completed", "weights.published"], on, stop=stop, caught_up=caught))
    await asyncio.wait_for(caught.wait(), 30)
    stop.set()
    await task
    # Micro-steps were consumed from the work queue; their blobs stay in the object store.
    step = 0
    while True:
        index = 0
        found = False
        while True:
            try:
                blob = await bus.get_object(f"step-{step}/mstep-{index}")
            except KeyError:
                break
            microsteps.append(from_bytes(blob))
            found = True
            index += 1
        if not found:
            break
        step += 1
    await bus.close()
    return calls, microsteps, weights


def test_toy_loop_end_to_end(tmp_path, nats_server):
    runs = tmp_path / "runs"
    env = dict(os.environ, GYRE_RUNS_DIR=str(runs), GYRE_NATS_URL=nats_server.url,
               GYRE_NATS_TOKEN=nats_server.token, HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "handlers.cli", "run", "toy", "--run-id", "e2e", "--timeout", "600"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    run_dir = runs / "e2e"
    logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}"
                     for p in sorted((run_dir / "logs").glob("*.log"))) if (run_dir / "logs").exists() else ""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + logs
    # The console carries progress and the summary; `gyre run`'s own log lines (and no
    # progress bar of the model's first save) go to logs/run.log beside the daemons'.
    assert '"event"' not in proc.stderr and "Writing model shards" not in proc.stderr, proc.stderr[-2000:]
    assert "bus.connected" in (run_dir / "logs" / "run.log").read_text()

    summary = json.loads((run_dir / "summary.json").read_text())
    for key in ("steps", "executions", "calls", "tokens_trained", "zero_variance_groups",
                "grad_norm_per_step", "policy_version", "rewards_per_step"):
        assert key in summary, key
    assert summary["steps"] == 2 and summary["policy_version"] == 2
    assert summary["executions"] == 16 and summary["executions_without_calls"] == 0
    # Rewards differed inside at least one group, so the first step has a gradient.
    assert summary["grad_norm_per_step"][0] > 0
    assert summary["tokens_trained"] > 0

    # Every step's metrics reach metrics.jsonl: loss, gradient norm, clip fraction, sequence
    # ratios, KL between behaviour and current policy, tokens, micro-steps per replica,
    # staleness histogram and time per phase.
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    completed = [line for line in lines if line["kind"] == "step.completed"]
    assert [line["step"] for line in completed] == [0, 1]
    for line in completed:
        assert isinstance(line["loss"], float) and line["grad_norm"] > 0 and 0 <= line["clip_fraction"] <= 1
        assert set(line["ratio"]) == {"mean", "std", "min", "max"} and line["kl"] >= 0
        assert sum(line["microsteps_per_replica"].values()) == line["microsteps"] > 0
        assert sum(line["staleness_histogram"].values()) == line["tokens"] > 0
        assert set(line["phase_s"]) == {"waiting_for_grants", "forward_backward", "reduction", "optimizer", "checkpoint"}
        assert line["phase_s"]["forward_backward"] > 0 and line["phase_s"]["checkpoint"] > 0

    calls, microsteps, weights = asyncio.run(_collect(nats_server, "e2e"))
    assert calls and microsteps
    # Calls after the first update were served by the new policy version.
    step1_versions = {v for c in calls if c.execution.startswith("s1-") for _s, _e, v in c.versions}
    step0_versions = {v for c in calls if c.execution.startswith("s0-") for _s, _e, v in c.versions}
    assert step0_versions == {0} and step1_versions == {1}

    # The served weights changed: v1 differs from the initial model.
    assert [w.policy_version for w in sorted(weights, key=lambda w: w.policy_version)] == [1, 2]
    initial = load_file(str(run_dir / "model" / "model.safetensors"))
    v1 = load_file(str(Path(weights[0].path) / "model.safetensors"))
    assert any(not np.array_equal(initial[k], v1[k]) for k in initial)

    # Every trained token is, at its place, an id the engine sampled, with its behaviour log-prob.
    by_id = {c.call: c for c in calls}

    def full(call_id):
        c = by_id[call_id]
        ids, lps, policy = ([], [], []) if c.parent_call is None else [x[: c.prefix_len] for x in full(c.parent_call)]
        ids = ids + list(c.tokens.prompt_ids) + list(c.tokens.completion_ids)
        lps = lps + [0.0] * len(c.tokens.prompt_ids) + list(c.tokens.logprobs)
        policy = policy + [False] * len(c.tokens.prompt_ids) + [True] * len(c.tokens.completion_ids)
        return ids, lps, policy

    checked = 0
    for ms in microsteps:
        b = ms.cu_seqlens
        for i in range(ms.n_trajectories):
            ids, lps, policy = full(ms.leaves[i])
            assert ms.input_ids[b[i]:b[i + 1]].tolist() == ids
            mask = ms.loss_mask[b[i]:b[i + 1]]
            assert not np.any(mask & ~np.array(policy)), "a context token carries loss"
            assert np.allclose(ms.behaviour_logprobs[b[i]:b[i + 1]][mask], np.array(lps)[mask], atol=1e-6)
            checked += int(mask.sum())
    assert checked == sum(m.n_trained for m in microsteps) > 0
