"""Example external reward service for gyre (docs/reward-services.md). Copy it and change `score`.

Consumes `execution.finished` of one run through its own durable consumer and publishes one
`execution.scored` per execution (Nats-Msg-Id `<run>:<execution>:scored:<attempt>`).
Here the reward is 1.0 when `--command` exits 0 inside the preserved workspace, else 0.0.

    GYRE_NATS_URL=nats://127.0.0.1:PORT GYRE_NATS_TOKEN=... python reward_service_example.py RUN --command "pytest -q"
"""
import argparse, asyncio, datetime, json, os, subprocess

import nats
import nats.errors
from nats.js.api import ConsumerConfig


def score(finished: dict, command: str, timeout_s: float) -> dict:
    """The outcome fields of `execution.scored` for one `execution.finished` payload."""
    if finished["status"] == "no_workspace" or not finished["workspace"]:
        return {"outcome": "placeholder", "reward": 0.0, "reason": "no workspace"}
    if finished["status"] == "harness_error" or not os.path.isdir(finished["workspace"]):
        return {"outcome": "excluded", "reward": None, "reason": f"cannot judge (status {finished['status']})"}
    try:  # status ok or timeout: judge what the workspace holds (partial credit)
        done = subprocess.run(command, shell=True, cwd=finished["workspace"], timeout=timeout_s, capture_output=True)
    except subprocess.TimeoutExpired:
        return {"outcome": "excluded", "reward": None, "reason": f"scoring took over {timeout_s}s"}
    return {"outcome": "reward", "reward": 1.0 if done.returncode == 0 else 0.0, "reason": ""}


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run"); p.add_argument("--command", default="test -f DONE"); p.add_argument("--timeout", type=float, default=300.0)
    a = p.parse_args()
    nc = await nats.connect(os.environ.get("GYRE_NATS_URL", "nats://127.0.0.1:4222"), token=os.environ.get("GYRE_NATS_TOKEN"))
    js = nc.jetstream()
    prefix, stream = f"gyre.v1.{a.run}", f"GYRE_{a.run.upper().replace('-', '_')}_EXECUTIONS"
    sub = await js.pull_subscribe(f"{prefix}.execution.finished", durable="reward-example-v1", stream=stream,
                                  config=ConsumerConfig(ack_wait=a.timeout + 60))
    while True:
        try:
            msgs = await sub.fetch(1, timeout=5)
        except nats.errors.TimeoutError:
            continue
        for msg in msgs:
            finished = json.loads(msg.data)
            result = await asyncio.to_thread(score, finished, a.command, a.timeout)
            event_id = f"{a.run}:{finished['info']['execution']}:scored:0"
            scored = {"event_id": event_id, "schema_version": 1, "info": finished["info"], "attempt": 0, **result,
                      "emitted_at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")}
            await js.publish(f"{prefix}.execution.scored", json.dumps(scored).encode(), headers={"Nats-Msg-Id": event_id})
            await msg.ack()  # only after the PubAck: a crash in between re-scores, and the id deduplicates


if __name__ == "__main__":
    asyncio.run(main())
