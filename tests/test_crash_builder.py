"""The builder restarts without loss after kill -9 (issue 52): a real builder process holding
the calls of an unsealed step (acked, so only in its memory) and a group's first score is
SIGKILLed; its successor rebuilds the trees from the run's streams, and the run's
micro-steps and seals are exactly an uninterrupted builder's, each published once."""
from __future__ import annotations

import asyncio
import collections
import dataclasses

import numpy as np

import schemas
from bus import Bus
from gyre.config import load_recipe
from gyre.trajectory.builder import BuilderPolicy
from gyre.trajectory.microstep import MicrostepData, from_bytes, to_bytes
from handlers.audit import audit
from schemas import ids
from tests.crash import Daemons, make_run_dir, until

GROUPS = {0: ("s0-g0", "s0-g1", "s0-g2"), 1: ("s1-g0",)}
BUDGET = 48


def _info(run, e):
    step = int(e[1])
    return schemas.ExecutionInfo(execution=e, task="t", group=e.rsplit("-", 1)[0], step=step, harness="toy",
                                 group_size=2, step_groups=len(GROUPS[step]))


def _calls(run, e, k):
    """Two chained calls (the second extends the first), distinct tokens per execution."""
    base = 100 + 37 * k
    first_prompt, first_out = list(range(base, base + 12)), [base + 50 + i for i in range(6 + k % 3)]
    second_prompt, second_out = [base + 70, base + 71], [base + 80 + i for i in range(5 + k % 4)]
    out = []
    for seq, (prompt, completion, parent, prefix) in enumerate((
            (first_prompt, first_out, None, 0),
            (second_prompt, second_out, f"{e}:0", len(first_prompt) + len(first_out)))):
        out.append(schemas.CallCompleted(
            event_id=ids.call(run, e, seq), call=f"{e}:{seq}", execution=e, seq=seq, parent_call=parent,
            prefix_len=prefix, tokens=schemas.CallTokens(prompt_ids=prompt, completion_ids=completion,
                                                         logprobs=[-0.5 - 0.01 * i for i in range(len(completion))]),
            sampling=schemas.SamplingParams(), finish_reason="stop", versions=[(0, len(completion), 0)],
            cell="cell0", role="main"))
    return out


def _score(run, e, reward):
    return schemas.ExecutionScored(event_id=ids.scored(run, e, 0), info=_info(run, e), outcome="reward", reward=reward)


def _same(got: MicrostepData, want: MicrostepData) -> None:
    want = from_bytes(to_bytes(want))  # as stored (float32, run-length versions)
    for f in dataclasses.fields(MicrostepData):
        a, b = getattr(got, f.name), getattr(want, f.name)
        assert (np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b), (got.step, got.index, f.name)


async def _stored(bus, name):
    return await bus.stored_events([name])


async def test_a_builder_killed_holding_an_unsealed_steps_calls_rebuilds_them_and_publishes_each_microstep_once(
        nats_server, run_id, tmp_path):
    recipe = load_recipe("toy", {"train.microstep_tokens": BUDGET})
    run_dir = make_run_dir(tmp_path / run_id, run_id, nats_server, recipe)
    executions = [f"{g}-e{i}" for step in GROUPS for g in GROUPS[step] for i in range(2)]
    calls = [c for k, e in enumerate(executions) for c in _calls(run_id, e, k)]
    rewards = {e: float(i % 2 == 0) if "g2" not in e else 0.25 + 0.5 * i
               for e in executions for i in [int(e[-1])]}
    first_scores = [_score(run_id, e, rewards[e]) for e in ("s0-g0-e0", "s0-g0-e1", "s0-g1-e0")]
    later_scores = [_score(run_id, e, rewards[e]) for e in ("s0-g2-e1", "s0-g1-e1", "s0-g2-e0", "s1-g0-e1",
                                                          "s1-g0-e0")]
    # What an uninterrupted builder makes of the same facts in the same order.
    ref = BuilderPolicy(j_max=recipe.train.j_max, max_staleness=recipe.train.max_staleness, token_budget=BUDGET,
                        seed=recipe.run.seed)
    for c in calls:
        ref.add_call(c)
    expected, seals = {}, {}
    for s in first_scores + later_scores:
        microsteps, sealed = ref.add_score(s)
        expected.update({(m.step, m.index): m for m in microsteps})
        if sealed is not None:
            seals[sealed.step] = sealed
    g0 = [k for k, m in expected.items() if set(m.executions) <= {"s0-g0-e0", "s0-g0-e1"}]
    assert len(g0) >= 2 and len(expected) > len(g0) + 2, "the budget packs each group into several micro-steps"

    bus = await Bus.connect(nats_server.url, token=nats_server.token, run=run_id, name="test")
    await bus.ensure_streams()
    daemons = Daemons(run_dir)
    try:
        daemons.start("builder")
        for c in calls:
            await bus.publish(c)
        for s in first_scores:
            await bus.publish(s)

        async def holding():
            ready = await _stored(bus, schemas.MicrostepReady.NAME)
            return (len(ready) == len(g0) and await bus.consumer_backlog("builder-calls-v1") == 0
                    and await bus.consumer_backlog("builder-v1") == 0)

        await until(holding, "the first builder to take every call and group s0-g0's micro-steps", 90,
                    check=daemons.alive)
        # It holds unfinished work: every call acked (in its memory only), step 0 not sealed,
        # s0-g1's first score taken.
        assert await _stored(bus, schemas.StepSealed.NAME) == []
        assert daemons.kill9("builder") == -9

        daemons.start("builder")
        for s in later_scores:
            await bus.publish(s)
        await until(lambda: _sealed_steps(bus), "both steps sealed by the restarted builder", 90,
                    check=daemons.alive)
        await asyncio.sleep(1.0)  # anything published twice would be stored by now
        assert "builder.recovered" in daemons.log("builder")

        ready = await _stored(bus, schemas.MicrostepReady.NAME)
        counts = collections.Counter(e.event_id for e in ready)
        assert max(counts.values()) == 1, counts
        assert {(e.step, e.microstep) for e in ready} == set(expected)
        for e in ready:
            _same(from_bytes(await bus.get_object(e.key)), expected[(e.step, e.microstep)])
            assert e.event_id == ids.microstep(run_id, e.step, e.microstep)
        sealed = await _stored(bus, schemas.StepSealed.NAME)
        assert sorted(e.step for e in sealed) == [0, 1]
        for e in sealed:
            want = seals[e.step]
            assert (e.microsteps, e.executions, e.groups, e.zero_variance_groups, e.reward_mean) == (
                want.microsteps, want.executions, want.groups, want.zero_variance_groups, want.reward_mean)
        result = await audit(bus, run_dir, answered={e: 2 for e in executions})
        assert (result.calls_lost, result.samples_duplicated, result.steps_sealed) == (0, 0, 2), result
    finally:
        daemons.stop()
        await bus.close()


async def _sealed_steps(bus) -> bool:
    return len({e.step for e in await _stored(bus, schemas.StepSealed.NAME)}) == 2
