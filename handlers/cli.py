"""The `gyre` command.

    gyre run RECIPE [--set table.key=value ...] [--run-id ID] [--timeout S] [--no-evaluator]
                                                  start everything, show progress, exit 0
    gyre run --resume RUN_DIR [--timeout S] [--no-evaluator]
                                                  go on with a run whose processes all died (a reboot)
    gyre tap [PATTERN] [--run-dir DIR] [--run ID | --all-runs] [--width N]
                                                  print live events of the current run
    gyre status [--run ID | --run-dir DIR] [--once]  a live view of the current run (cells, executions, rewards)
    gyre report [RUN_DIR]                         write RUN_DIR/report.html with the run's pictures
    gyre init-model DIR [--layers N ...] [--warm-start majority]
                                                  write the embedded default model (optionally warm-started)
    gyre bench NAME [--json PATH]                 a benchmark of docs/BENCHMARKS.md (proxy, trajectories, hostile, transfer, learning, modes, chaos)
    gyre sim [--profile NAME|all] [--random N --seed S] [--trace PATH] [--json PATH]
                                                  the scheduling modes on simulated clusters
    gyre proxy|cell|scheduler|builder|runner|evaluator --run-dir DIR   one daemon
                                                  (gyre proxy --engine-url URL: an engine of your own while no cell rolls out)
    gyre DAEMON --help, gyre run --help, ...      each command's options
"""
from __future__ import annotations

import sys

USAGE = __doc__


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE.strip())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "run":
        from handlers.run import main as run_main
        return run_main(rest)
    if command == "tap":
        from handlers.tap import main as tap_main
        return tap_main(rest)
    if command == "status":
        from handlers.status import main as status_main
        return status_main(rest)
    if command == "report":
        from handlers.report import main as report_main
        return report_main(rest)
    if command == "init-model":
        return _init_model(rest)
    if command == "bench":
        return _bench(rest)
    if command == "sim":
        from gyre.sim.command import main as sim_main
        return sim_main(rest)
    daemons = {
        "proxy": "handlers.proxy.daemon",
        "cell": "handlers.cell",
        "scheduler": "handlers.scheduler",
        "builder": "handlers.builder",
        "runner": "handlers.runner",
        "evaluator": "handlers.evaluator",
    }
    if command in daemons:
        import importlib
        return importlib.import_module(daemons[command]).main(rest)
    print(f"gyre: unknown command {command!r}\n\n{USAGE.strip()}", file=sys.stderr)
    return 2


BENCHMARKS = {
    "proxy": "handlers.bench.proxy",
    "trajectories": "handlers.bench.trajectories",
    "hostile": "handlers.bench.hostile",
    "transfer": "handlers.bench.transfer",
    "learning": "handlers.bench.learning",
    "modes": "handlers.bench.modes",
    "chaos": "handlers.bench.chaos",
}
"""`gyre bench NAME` → the module whose `main(argv) -> int` runs it (BENCHMARKS.md)."""


def _bench(argv: list[str]) -> int:
    import importlib

    usage = f"usage: gyre bench NAME [--json PATH] ...  (NAME: {', '.join(BENCHMARKS)}; gyre bench NAME --help)"
    if argv[:1] in (["-h"], ["--help"]):
        print(usage)
        return 0
    if not argv or argv[0].startswith("-"):
        print(usage, file=sys.stderr)
        return 2
    module_name = BENCHMARKS.get(argv[0].replace("-", "_"))
    if module_name is None:
        print(f"gyre bench: unknown benchmark {argv[0]!r} (one of: {', '.join(BENCHMARKS)})", file=sys.stderr)
        return 2
    return importlib.import_module(module_name).main(argv[1:])


def _init_model(argv: list[str]) -> int:
    import argparse
    import re

    from gyre.serving.model import ModelSpec, init_model

    p = argparse.ArgumentParser(prog="gyre init-model", description="Write the embedded default model (HF checkpoint).")
    p.add_argument("dir", help="where to write it (created)")
    p.add_argument("--layers", type=int, default=2, help="transformer layers (default 2)")
    p.add_argument("--hidden", type=int, default=64, help="hidden size (default 64)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads, grouped-query attention (default 2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    p.add_argument("--warm-start", default="", metavar="FAMILY",
                   help="then a short supervised warm start on a task family gyre generates (majority)")
    p.add_argument("--warm-start-steps", type=int, default=200, help="steps of that warm start (default 200)")
    a = p.parse_args(argv)
    from pathlib import Path

    if Path(a.dir).exists() and (not Path(a.dir).is_dir() or any(Path(a.dir).iterdir())):
        p.error(f"{a.dir} exists and is not an empty directory; choose a new one")
    if a.heads > 0 and (a.hidden % a.heads or (a.hidden // a.heads) % 2):
        p.error(f"--hidden must be --heads times an even head size (rotary embeddings): {a.hidden} / {a.heads}")
    try:
        spec = ModelSpec(layers=a.layers, hidden=a.hidden, heads=a.heads, kv_heads=a.kv_heads,
                         head_dim=a.hidden // a.heads if a.heads > 0 else 0, intermediate=3 * a.hidden, seed=a.seed)
    except ValueError as exc:
        p.error(re.sub(r"\b(?:ModelSpec\.)?(layers|hidden|heads|kv_heads|seed)\b",
                       lambda m: "--" + m[1].replace("_", "-"), str(exc)))
    from gyre.learning.warm_start import FAMILIES, warm_start

    if a.warm_start and a.warm_start not in FAMILIES:
        p.error(f"--warm-start {a.warm_start!r} is not a task family; known: {', '.join(FAMILIES)}")
    if a.warm_start_steps < 0:
        p.error("--warm-start-steps must be >= 0")
    path = init_model(a.dir, spec)
    if a.warm_start:
        stats = warm_start(path, a.warm_start, a.warm_start_steps, seed=a.seed)
        print(f"warm start on {a.warm_start!r}: {a.warm_start_steps} steps in {stats['seconds']} s, "
              f"success rate ≈ {stats['success']:.3f}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
