"""The crash audit (handlers.audit) counts each kind of loss and double count it names, on a
real nats-server: a run that lost a call, announced a micro-step twice, packed an execution
into two steps, committed a micro-step twice, trained more micro-steps than its seal
announced and dispatched an execution twice is reported so, fact by fact."""
from __future__ import annotations

import schemas
from bus import Bus
from handlers.audit import answered_calls, audit, harness_launches
from schemas import ids


def _call(run, e, seq):
    return schemas.CallCompleted(
        event_id=ids.call(run, e, seq), call=f"{e}:{seq}", execution=e, seq=seq, parent_call=None, prefix_len=0,
        tokens=schemas.CallTokens(prompt_ids=[1, 2], completion_ids=[3], logprobs=[-0.1]),
        sampling=schemas.SamplingParams(), finish_reason="stop", versions=[(0, 1, 0)], cell="cell0", role="main")


def _ready(run, step, index, execution, event_id=None):
    return schemas.MicrostepReady(
        event_id=event_id or ids.microstep(run, step, index), step=step, microstep=index,
        key=f"step-{step}/mstep-{index}", executions=(schemas.MicrostepExecution(execution=execution, n_tokens=1,
                                                                                  advantage=1.0),),
        tokens=3, trained=1, trajectories=1)


def _committed(run, epoch, step, index, suffix=""):
    return schemas.MicrostepCommitted(event_id=ids.committed(run, epoch, step, index) + suffix, step=step,
                                      microstep=index, replica="cell0", epoch=epoch)


async def test_the_audit_names_every_loss_and_double_count(nats_server, run_id, tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "logs" / "executions").mkdir(parents=True)
    # client side: e1's harness got 3 answers, e2's 1
    (run_dir / "logs" / "executions" / "s0-g0-e1.log").write_text(
        "toy_harness: call 0: 'a'\ntoy_harness: call 1: 'b'\nnoise\ntoy_harness: call 2: 'c'\n")
    (run_dir / "logs" / "executions" / "s0-g0-e2.log").write_text("toy_harness: call 0: 'x'\n")
    (run_dir / "logs" / "runner.log").write_text(
        '{"execution": "s0-g0-e2", "event": "runner.harness.started"}\nnot json runner.harness.started\n'
        '{"execution": "s0-g0-e2", "event": "runner.harness.started"}\n')
    assert answered_calls(run_dir) == {"s0-g0-e1": 3, "s0-g0-e2": 1}
    assert harness_launches(run_dir) == {"s0-g0-e2": 2}
    bus = await Bus.connect(nats_server.url, token=nats_server.token, run=run_id, name="test")
    try:
        await bus.ensure_streams()
        clean = await audit(bus, tmp_path / "empty", answered={})
        assert clean.clean() and (clean.calls_recorded, clean.steps_completed) == (0, 0)
        for e in (_call(run_id, "s0-g0-e1", 0), _call(run_id, "s0-g0-e1", 1), _call(run_id, "s0-g0-e2", 0)):
            await bus.publish(e)
        await bus.publish(_ready(run_id, 0, 0, "s0-g0-e1"))
        await bus.publish(_ready(run_id, 0, 0, "s0-g0-e1", event_id=f"{run_id}:republished"))  # past the window
        await bus.publish(_ready(run_id, 1, 0, "s0-g0-e1"))  # the same execution packed into step 1 as well
        await bus.publish(_committed(run_id, 0, 0, 0))
        await bus.publish(_committed(run_id, 0, 0, 0, suffix=":again"))
        await bus.publish(_committed(run_id, 1, 0, 0))  # a new epoch's commit of it counts for itself
        await bus.publish(schemas.StepSealed(event_id=ids.sealed(run_id, 0), step=0, microsteps=1, executions=1,
                                             groups=1))
        await bus.publish(schemas.StepCompleted(event_id=ids.step_completed(run_id, 0), step=0, loss=0.1, grad_norm=1.0,
                                                tokens=3, executions=1, policy_version=1, microsteps=2,
                                                microsteps_per_replica={"cell0": 1, "cell1": 1}))
        for seq, cell in ((0, "cell0"), (1, "cell1")):
            await bus.publish(schemas.RouteUpdated(event_id=ids.route(run_id, seq), seq=seq, routes=(
                schemas.Route(execution="s0-g0-e1", cell=cell),)))
        await bus.publish(schemas.RouteUpdated(event_id=ids.route(run_id, 2), seq=2, routes=(
            schemas.Route(execution="s0-g0-e1", cell="cell0", reason="cell1 to training"),)))
        got = await audit(bus, run_dir)
    finally:
        await bus.close()
    assert (got.calls_answered, got.calls_recorded, got.calls_lost) == (4, 3, 1), got
    assert got.details["calls_lost"] == {"s0-g0-e1": 1}
    assert got.samples_duplicated == 2 and got.details["microsteps_ready_repeated"] == {"0:0": 1}, got
    assert got.details["executions_in_two_steps"] == {"s0-g0-e1": [0, 1]}
    assert got.microsteps_double_counted == 2 and got.details["microsteps_committed_repeated"] == {"0:0:0": 1}, got
    assert got.details["microsteps_over_sealed"] == {0: 1}
    assert got.executions_dispatched_twice == 2 and got.details["executions_dispatched_twice"] == [
        "s0-g0-e1", "s0-g0-e2"]
    assert (got.steps_sealed, got.steps_completed) == (1, 1) and not got.clean()
