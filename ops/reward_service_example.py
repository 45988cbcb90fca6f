"""Example external reward service for gyre (docs/reward-services.md). Copy it and change `score`.

Consumes `execution.finished` of one run through its own durable consumer and publishes one
`execution.scored` per execution (Nats-Msg-Id `<run>:<execution>:scored:<attempt>`).
Here the reward is 1.0 when `--command` exits 0 inside the preserved workspace, else 0.0.

    GYRE_NATS_URL=nats://127.0.0.1:PORT GYRE_NATS_TOKEN=... python reward_service_example.py RUN --command "pytest -q"

It prints one line per score and exits 0 once the run's bus has gone (the run ended).
"""
import argparse, asyncio, datetime, json, os, subprocess, sys

import nats
import nats.errors
import nats.js.errors
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
    if not os.environ.get("GYRE_NATS_URL"):
        sys.exit("set GYRE_NATS_URL (and GYRE_NATS_TOKEN) from runs/<run>/nats.json")
    gone = asyncio.Event()

    async def closed() -> None:
        gone.set()

    async def quiet(exc: Exception) -> None:  # reconnect attempts: the closed callback tells the end
        pass

    nc = await nats.connect(os.environ["GYRE_NATS_URL"], token=os.environ.get("GYRE_NATS_TOKEN"),
                            max_reconnect_attempts=5, closed_cb=closed, error_cb=quiet)
    js = nc.jetstream()
    prefix, stream = f"gyre.v1.{a.run}", f"GYRE_{a.run.upper().replace('-', '_')}_EXECUTIONS"
    for _ in range(60):  # the run creates its streams a moment after it writes nats.json
        try:
            sub = await js.pull_subscribe(f"{prefix}.execution.finished", durable="reward-example-v1", stream=stream,
                                          config=ConsumerConfig(ack_wait=a.timeout + 60))
            break
        except nats.js.errors.NotFoundError:
            await asyncio.sleep(1)
    else:
        sys.exit(f"no stream {stream}: is run {a.run} started?")
    print(f"scoring run {a.run} with {a.command!r}", flush=True)
    while not gone.is_set():
        try:
            msgs = await sub.fetch(1, timeout=5)
        except nats.errors.TimeoutError:
            continue
        except nats.errors.Error:  # the connection is going: the loop ends once it has closed
            await asyncio.sleep(1)
            continue
        for msg in msgs:
            finished = json.loads(msg.data)
            result = await asyncio.to_thread(score, finished, a.command, a.timeout)
            event_id = f"{a.run}:{finished['info']['execution']}:scored:0"
            scored = {"event_id": event_id, "schema_version": 1, "info": finished["info"], "attempt": 0, **result,
                      "emitted_at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")}
            try:
                await js.publish(f"{prefix}.execution.scored", json.dumps(scored).encode(),
                                 headers={"Nats-Msg-Id": event_id})
                await msg.ack()  # only after the PubAck: a crash in between re-scores, and the id deduplicates
            except nats.errors.Error as exc:  # not acked: delivered again once the bus is back
                print(f"{finished['info']['execution']}: not published ({exc!r}); it comes back", flush=True)
                continue
            print(f"{finished['info']['execution']}: {result['outcome']} {result['reward']} {result['reason']}", flush=True)
    print("the run's bus has gone: done", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
