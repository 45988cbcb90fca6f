"""Every daemon's Prometheus `/metrics` (prometheus_client): the names of docs/metrics.md.

Contract:
- `serve(daemon, run_dir, host, port)` starts the text-format endpoint on `host:port`
  (default 127.0.0.1 and a free port) on a thread of its own, and records its URL in
  `<run_dir>/metrics/<daemon>.json` so `gyre status`, `gyre run` (its last scrape,
  `<daemon>.prom`) and scrapers find it. The file is a Prometheus file-based service
  discovery list, `[{"targets": ["host:port"], "labels": {"daemon", "run", "url", "pid"}}]`,
  so `ops/prometheus.yml` scrapes every daemon of every run from `runs/*/metrics/*.json`. `daemon_main` calls it once per
  daemon; nothing else needs to. `forget(run_dir, daemon)` removes the file as the daemon
  stops (`daemon_main` does; `gyre run` removes what a killed daemon left), so scrapers stop
  asking a dead port; the run's last counters stay in `<daemon>.prom`.
- Counters are fed by what the daemon itself publishes (`bus.client.PUBLISH_OBSERVERS`,
  events the bus stored for the first time only, so a re-sent event is never counted
  twice): the daemon that owns an event owns its metric — the proxy calls and tokens
  generated, the runner executions finished, the evaluator executions scored, the core cell
  steps, tokens trained and micro-steps committed, every cell its role, its switches (their
  phases and bytes, `cell.switched`) and the KV tokens its engine imported (`kv.pulled`). The scheduler sets the water level (`WATER_LEVEL`); the
  embedded engine's server counts prefilled tokens (`ENGINE_PREFILL`), the proxy's dispatcher
  its retries (`PROXY_RETRIES`). Every daemon has its bus publish latency
  and dead letters.
- Each metric's label values are bounded by the run's shape (APIs, statuses, cells,
  phases), never by executions or calls.
"""
from __future__ import annotations

import os
from pathlib import Path

import orjson
from prometheus_client import Counter, Gauge, Histogram, start_http_server

import schemas
from bus import client as bus_client

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_STEP_BUCKETS = (0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)

CALLS = Counter("gyre_calls", "Model calls recorded by the proxy (call.completed)", ["api", "status"])
CALL_LATENCY = Histogram("gyre_call_latency_seconds", "A model call's time in the proxy, request to answer "
                         "(call.completed timings.total_s)", ["api"], buckets=_LATENCY_BUCKETS)
TOKENS_GENERATED = Counter("gyre_tokens_generated", "Completion tokens the proxy recorded (call.completed)")
TOKENS_TRAINED = Counter("gyre_tokens_trained", "Trained tokens of completed steps (step.completed)")
EXECUTIONS = Counter("gyre_executions_finished", "Executions whose harness process ended (execution.finished)",
                     ["outcome"])
SCORED = Counter("gyre_executions_scored", "Executions scored (execution.scored)", ["outcome"])
WATER_LEVEL = Gauge("gyre_water_level", "Executions dispatched minus finished, w(t) (the scheduler)")
CELL_ROLE = Gauge("gyre_cell_role", "1 for the role a cell holds now, 0 for the others (cell.switched)",
                  ["cell", "role"])
SWITCH = Histogram("gyre_switch_seconds", "A cell's switch, by direction and phase (cell.switched durations)",
                   ["direction", "phase"], buckets=_LATENCY_BUCKETS)
SWITCH_BYTES = Counter("gyre_switch_bytes", "Bytes a cell's switches freed (tensor storage of the role left) and "
                       "pulled (weight snapshots, KV blocks), by direction (cell.switched bytes)", ["direction", "kind"])
STEP_TIME = Histogram("gyre_step_seconds", "A step, first claimed micro-step to published weights "
                      "(step.completed duration_s)", buckets=_STEP_BUCKETS)
STEPS = Counter("gyre_steps_completed", "Optimizer steps applied (step.completed)")
MICROSTEPS = Counter("gyre_microsteps_committed", "Micro-steps the core's ledger committed (microstep.committed)",
                     ["replica"])
ENGINE_PREFILL = Counter("gyre_engine_prefill_tokens", "Prompt tokens the cell's engine ran through the model "
                         "(cached prefix tokens are not)")
ENGINE_KV_IMPORTED = Counter("gyre_engine_kv_imported_tokens", "Positions of KV blocks pulled from another cell "
                             "and kept by the cell's engine (kv.pulled tokens)")
PROXY_RETRIES = Counter("gyre_proxy_retries", "Engine attempts of a call the proxy gave up and sent again",
                        ["reason"])
PUBLISH_LATENCY = Histogram("gyre_bus_publish_seconds", "Bus.publish to its PubAck, retries included",
                            ["event"], buckets=_LATENCY_BUCKETS)
DEAD_LETTERS = Counter("gyre_dead_letters", "Events this daemon sent to the run's dead letters", ["event"])

ROLES = ("idle", "rollout", "training")


def completion_tokens(event: schemas.CallCompleted) -> int:
    """Completion tokens of a call: the end of its version spans (they cover [0, C)), else its
    inline completion ids (an aborted call may carry no spans)."""
    ends = [end for _start, end, _v in event.versions]
    return max(ends) if ends else len(event.tokens.completion_ids)


def observe(name: str, event: schemas.Event | None, seconds: float, stored: bool) -> None:
    """A `bus.client.PUBLISH_OBSERVERS` entry: the metrics of what this process published."""
    if name.startswith("dlq."):
        DEAD_LETTERS.labels(name[4:]).inc()
        return
    PUBLISH_LATENCY.labels(name).observe(seconds)
    if not stored:  # the server had it already: counted when it was first stored
        return
    if isinstance(event, schemas.CallCompleted):
        CALLS.labels(event.api, event.status).inc()
        if "total_s" in event.timings:
            CALL_LATENCY.labels(event.api).observe(float(event.timings["total_s"]))
        TOKENS_GENERATED.inc(completion_tokens(event))
    elif isinstance(event, schemas.ExecutionFinished):
        EXECUTIONS.labels(event.status).inc()
    elif isinstance(event, schemas.ExecutionScored):
        SCORED.labels(event.outcome).inc()
    elif isinstance(event, schemas.StepCompleted):
        STEPS.inc()
        TOKENS_TRAINED.inc(event.tokens)
        STEP_TIME.observe(event.duration_s)
    elif isinstance(event, schemas.MicrostepCommitted):
        MICROSTEPS.labels(event.replica).inc()
    elif isinstance(event, schemas.KvPulled):
        ENGINE_KV_IMPORTED.inc(event.tokens)
    elif isinstance(event, schemas.CellSwitched):
        for role in ROLES:
            CELL_ROLE.labels(event.cell, role).set(1 if role == event.to_role else 0)
        direction = f"{event.from_role}_to_{event.to_role}"
        for key, value in event.durations.items():
            if isinstance(value, (int, float)):
                SWITCH.labels(direction, key.removesuffix("_s")).observe(float(value))
        for key, value in event.bytes.items():
            if (key == "freed" or key.startswith("pulled_")) and isinstance(value, int) and value > 0:
                SWITCH_BYTES.labels(direction, key).inc(value)


def url_file(run_dir: Path, daemon: str) -> Path:
    return Path(run_dir) / "metrics" / f"{daemon}.json"


def serve(daemon: str, run_dir: Path, host: str = "127.0.0.1", port: int = 0, run: str = "") -> str:
    """Start `/metrics` on host:port (0: a free one), hook the publish observer, record the
    URL (module docstring); returns the URL. Raises OSError when the port is taken."""
    server, _thread = start_http_server(port, addr=host)
    bound = server.server_port
    shown = f"[{host}]" if ":" in host else host
    target = f"{shown}:{bound}"
    url = f"http://{target}/metrics"
    if observe not in bus_client.PUBLISH_OBSERVERS:
        bus_client.PUBLISH_OBSERVERS.append(observe)
    path = url_file(run_dir, daemon)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(orjson.dumps([{"targets": [target], "labels": {
        "daemon": daemon, "run": run or Path(run_dir).name, "url": url, "pid": str(os.getpid())}}]))
    os.replace(tmp, path)  # readers poll for it: never half-written
    return url


def forget(run_dir: Path, daemon: str, pid: int | None = None) -> None:
    """Remove `daemon`'s service discovery file: it stopped, nothing serves its URL now. With
    `pid`, only a file this process wrote (a restarted daemon's newer file stays)."""
    path = url_file(run_dir, daemon)
    try:
        if pid is not None and orjson.loads(path.read_bytes())[0]["labels"]["pid"] != str(pid):
            return
        path.unlink()
    except (OSError, orjson.JSONDecodeError, KeyError, TypeError, IndexError):
        pass


def recorded_urls(run_dir: Path) -> dict[str, str]:
    """daemon → metrics URL, from `<run_dir>/metrics/*.json`."""
    out = {}
    for path in sorted((Path(run_dir) / "metrics").glob("*.json")):
        try:
            labels = orjson.loads(path.read_bytes())[0]["labels"]
            out[labels["daemon"]] = labels["url"]
        except (OSError, orjson.JSONDecodeError, KeyError, TypeError, IndexError):
            continue
    return out


def scrape(url: str, timeout_s: float = 2.0) -> str:
    """The text of one `/metrics`. Raises OSError (urllib's URLError included)."""
    import urllib.request

    with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 - a URL the run recorded
        return resp.read().decode()


def scrape_all(run_dir: Path) -> dict[str, str]:
    """Scrape every recorded daemon once and keep the text as `<run_dir>/metrics/<daemon>.prom`
    (`gyre run` does it as the run ends, before stopping the daemons: their last counters).
    Returns daemon → text; a daemon that does not answer is left out."""
    out = {}
    for daemon, url in recorded_urls(run_dir).items():
        try:
            text = scrape(url)
        except OSError:
            continue
        (Path(run_dir) / "metrics" / f"{daemon}.prom").write_text(text)
        out[daemon] = text
    return out
