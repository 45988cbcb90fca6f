"""`gyre run --resume RUN_DIR`: go on with a run after every one of its processes died.

The machine rebooted, or `gyre run`, its daemons, its nats-server and its harnesses were all
killed: nothing of the run is left but its directory. What survives there, and what each
part rebuilds from it when `gyre run --resume` starts them again:

- `nats/js/`: the private nats-server's JetStream store (file storage). The resumed run
  starts a nats-server on the same store (a new port and token), so every stream, retained
  event, object-store blob (micro-steps) and durable consumer position is back: events a
  daemon had acked stay done, events it had not are delivered again. A run on an external
  server (`GYRE_NATS_URL`) finds its streams there.
- `weights/v<k>/`: the core's checkpoints (gyre.learning.checkpoint). The core restores the
  newest complete one, so weights, AdamW moments and step counts, the learning-rate schedule
  and torch's RNG state are those after the last completed step, raises its epoch
  (`weights/core_epoch`), and trains the interrupted step again from the micro-steps the
  builder announced; the old epoch's grants and commits count for nothing, so no micro-step
  is trained twice into one step.
- `trace.jsonl`: the scheduler rebuilds its policy from it (handlers.scheduler), so the
  water level, the cells' loaded versions, the bursts dispatched and the staleness gate are
  as they were: a resumed run dispatches only what the policy had not dispatched yet.
- `runner/<execution>.json`, `evaluator/<execution>.json`: an execution that finished or was
  scored is not run or scored again (its recorded fact is published again, deduplicated).
  An execution whose harness died with the machine (a workspace without a runner record) is
  finished `timeout` on its preserved workspace, which the evaluator scores (partial credit);
  it is never launched again (`GYRE_RESUMED`, handlers.runner).
- `key_secret`, `engine_token`, `config.json` (the recipe): reused. `model/` (the initial
  model, warm-started where the recipe says so) is reused once the daemons had started
  (`model_written`); a run killed before that writes it again (seeded: the same model).
- `metrics.jsonl`: kept; the resumed process's follower replays the whole run from the bus
  and appends only the lines the earlier process had not written (`written`, `line_key`),
  with `t` going on from the last line's.
- `summary.json` and the report are written again at the end, over the whole run.

Events a daemon had received and not acked at the kill come back once their ack wait
(counted from their delivery) has passed: at once after a reboot longer than that, else
within `runner-v1`'s 60 s or a cell's 120 s.

Not recovered: calls in flight at the kill (their harness is gone; the execution is scored
as timed out on its workspace).
"""
from __future__ import annotations

import collections
import os
from pathlib import Path

import orjson

RESUMED_ENV = "GYRE_RESUMED"
"""Set to "1" in the daemons of a resumed run (handlers.runner reads it)."""

# The metrics lines of one fact, whatever else a replay computes differently (a reward
# mean over the scores the follower had seen, a step.completed republished by a restarted core).
_IDENTITY = {"execution.dispatched": ("execution",), "execution.finished": ("execution",),
             "execution.scored": ("execution",), "call.completed": ("call",), "step.completed": ("step",),
             "step.failed": ("step", "epoch")}


class ResumeError(Exception):
    """RUN_DIR cannot be resumed; the message says why (`gyre run` exits 2)."""


def resumed() -> bool:
    """Whether this daemon belongs to a resumed run (`RESUMED_ENV`)."""
    return os.environ.get(RESUMED_ENV) == "1"


def model_written(run_dir: Path) -> bool:
    """Whether `run_dir/model` is whole: `gyre run` starts its daemons (logs/proxy.log first)
    only after it wrote the model and its warm start."""
    return (Path(run_dir) / "model" / "config.json").is_file() and (Path(run_dir) / "logs" / "proxy.log").exists()


def line_key(fields: dict) -> bytes:
    """What identifies a metrics line (without its `t`): the fact it records."""
    kind = fields.get("kind")
    names = _IDENTITY.get(kind)
    if names is not None:
        return orjson.dumps([kind, *(fields.get(n) for n in names)])
    return orjson.dumps({k: v for k, v in fields.items() if k != "t"}, option=orjson.OPT_SORT_KEYS)


def written(metrics_path: Path) -> tuple[dict[bytes, int], float]:
    """(how often each `line_key` occurs, the last line's `t`) in `metrics_path`; a torn
    last line (the kill came mid-write) is cut off so the next line starts clean."""
    counts: collections.Counter[bytes] = collections.Counter()
    last_t = 0.0
    try:
        data = Path(metrics_path).read_bytes()
    except FileNotFoundError:
        return {}, 0.0
    good = 0
    for line in data.splitlines(keepends=True):
        try:
            fields = orjson.loads(line)
        except orjson.JSONDecodeError:
            break
        good += len(line)
        counts[line_key(fields)] += 1
        last_t = max(last_t, float(fields.get("t", 0.0)))
    if good < len(data):
        with open(metrics_path, "r+b") as f:
            f.truncate(good)
            if good and not data[:good].endswith(b"\n"):
                f.seek(good)
                f.write(b"\n")
    return dict(counts), last_t


def check(run_dir: Path) -> tuple[dict, str]:
    """(the recipe's dict from config.json, the run id) of a run that may be resumed.
    Raises ResumeError: no run directory, a run still alive, a run that is done, or a run
    whose events lived on an external NATS server that `GYRE_NATS_URL` does not name now."""
    from handlers.daemon import read_nats_info, run_owner_alive

    run_dir = Path(run_dir)
    if not (run_dir / "config.json").is_file():
        raise ResumeError(f"{run_dir} is not a run directory (no config.json)")
    try:
        info = read_nats_info(run_dir)
    except Exception:  # noqa: BLE001 - killed before it wrote nats.json: the run id is the directory's name
        info = {"run": run_dir.name}
    if info.get("pid") and run_owner_alive(info):
        raise ResumeError(f"run {info['run']} is still running (its `gyre run` is process {info['pid']})")
    try:
        summary = orjson.loads((run_dir / "summary.json").read_bytes())
    except (OSError, orjson.JSONDecodeError):
        summary = {}
    if summary.get("outcome") == "done":
        raise ResumeError(f"run {info['run']} is done already ({run_dir / 'summary.json'}: outcome done)")
    if not os.environ.get("GYRE_NATS_URL") and (run_dir / "trace.jsonl").exists() \
            and not (run_dir / "nats" / "js").is_dir():
        raise ResumeError(f"{run_dir} holds no JetStream store (nats/js): the run used an external NATS server; "
                          "set GYRE_NATS_URL (and GYRE_NATS_TOKEN) to it")
    return orjson.loads((run_dir / "config.json").read_bytes()), info["run"]


def main(run_dir: Path, timeout_s: float, no_evaluator: bool) -> int:
    """`gyre run --resume RUN_DIR`: check RUN_DIR (`check`), then run it again as `gyre run`
    does, reusing what survives (module docstring); without a built-in evaluator when the
    first run had none. Exit status as `gyre run`'s; 2 when RUN_DIR cannot be resumed."""
    import sys

    from gyre.config import RecipeError, recipe_from_dict
    from handlers.run import start

    run_dir = Path(run_dir).resolve()
    try:
        data, run = check(run_dir)
        recipe = recipe_from_dict(data)
    except (ResumeError, RecipeError) as exc:
        print(f"gyre run --resume: {exc}", file=sys.stderr)
        return 2
    logs = run_dir / "logs"
    logs.mkdir(exist_ok=True)
    # a run started with --no-evaluator stays without one (its daemons started, none was the evaluator)
    no_evaluator = no_evaluator or ((logs / "proxy.log").exists() and not (logs / "evaluator.log").exists())
    return start(recipe, run, run_dir, timeout_s, no_evaluator, resumed=True)
