"""A running daemon meets an undecodable event: dead-lettered with a warning, and the
daemon keeps handling the next good event (issue acceptance, checked on the builder)."""
import asyncio

import structlog

import schemas
from bus import Bus
from bus.subjects import dlq_subject, stream_for, subject
from handlers import builder
from schemas import ids


async def test_builder_dead_letters_garbage_and_keeps_running(nats_server, run_id):
    cfg = builder.Config(run=run_id, nats_url=nats_server.url, nats_token=nats_server.token)
    stop = asyncio.Event()
    with structlog.testing.capture_logs() as logs:
        daemon = asyncio.create_task(builder.run(cfg, stop))
        bus = await Bus.connect(nats_server.url, token=nats_server.token, run=run_id, name="test")
        await bus.ensure_streams()
        await bus.publish_raw(subject(run_id, "execution.scored"), b"\x00not json at all")
        info = schemas.ExecutionInfo(execution="e0", task="t", group="g0", step=0, harness="toy",
                                     group_size=1, step_groups=1)
        await bus.publish(schemas.ExecutionScored(event_id=ids.scored(run_id, "e0", 0), info=info,
                                                  outcome="reward", reward=1.0))
        sealed = []
        stop_replay = asyncio.Event()

        async def on_sealed(event):
            sealed.append(event)

        replay = asyncio.create_task(bus.replay(["step.sealed"], on_sealed, stop=stop_replay))
        dlq = stream_for("dlq.x").stream_name(run_id)
        for _ in range(100):
            if sealed:
                break
            await asyncio.sleep(0.1)
        msg = await bus.js.get_last_msg(dlq, dlq_subject(run_id, "execution.scored"))
        stop_replay.set()
        await replay
        stop.set()
        await daemon
        await bus.close()
    assert msg.data == b"\x00not json at all"
    assert [s.step for s in sealed] == [0]  # the good event after the bad one was handled
    assert any(e.get("log_level") == "warning" and e.get("event") == "bus.message.dead_lettered" for e in logs), logs
