"""`gyre bench trajectories [--json PATH]`: trajectory processing cost and savings (BENCHMARKS.md).

What it measures, on seeded synthetic Claude-Code-shaped executions (gyre.trajectory.synth), 8 per
size of 50K, 200K and 700K distinct tokens:
- *builder throughput*: tree → samples, excluding I/O — `build_tree` from decoded
  `call.completed` events, `trajectories(j_max=5, max_staleness=1)` and `Sample`s, as the
  builder does; tokens/s = the executions' distinct ids / seconds. Key
  `builder_tokens_per_s` (700K) with `_min`/`_max` and `builder_tokens_per_s_by_size`.
- *trained tokens* (Σ |K_τ| over the executions of a size) for three settings:
  `jmax1`, `jmax5` (role-priority sampling with masking, gyre.trajectory.tree) and `uncapped`:
  the full expansion — every root-to-leaf path, each trained on all its policy tokens,
  shared prefixes repeated (not `trajectories(j_max=None)`, which trains a shared token
  once). Keys `trained_tokens` (200K) and `trained_tokens_by_size`; `token_saving_jmax5`
  = 1 − jmax5 / uncapped on 200K.
- *forward-backward*: `gyre.learning.trainer.Trainer.accumulate` over the micro-steps of each
  setting (`gyre.trajectory.microstep.pack`, same token budget), on the embedded default model
  (`gyre.serving.model.init_model`, default spec), on the 50K executions, repetitions interleaved
  micro-step by micro-step (jmax1, jmax5, uncapped, jmax1, …, each micro-step timed). A = +1
  for every execution so no backward pass is skipped. jmax1/jmax5 run on the trainer's
  defaults, which compute a token prefix shared by several trajectories of a micro-step
  once, and are packed counting distinct positions; `uncapped` runs with that sharing off
  (`shared_prefix_min_tokens=0`, packed counting every position), every path on its own,
  as the expansion is defined.
  `fwd_bwd_decoder_positions` = decoder positions actually run (after cutting each path at
  its last trained token and sharing). Keys `fwd_bwd_s` (object per setting, median) with
  `fwd_bwd_s_min`/`_max`, `fwd_bwd_s_by_size`, `fwd_bwd_saving_jmax5` = 1 − jmax5 /
  uncapped (seconds; the median of the repetitions' savings, with `_min`/`_max`).
Reductions from the definition (e.g. fewer executions for forward-backward, to stay within
the time limit on two cores) are stated in `notes` and printed.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import orjson

from gyre.trajectory.microstep import Sample, pack
from gyre.trajectory.synth import SynthSpec, synth_executions
from gyre.trajectory.tree import CallTree, Trajectory, build_tree, trajectories
from gyre.progress import bar

SETTINGS = ("jmax1", "jmax5", "uncapped")
SIZES = (50_000, 200_000, 700_000)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class BenchConfig:
    """sizes: distinct tokens per execution, one group of executions per size.
    executions: executions per size. reps: repetitions (median reported).
    fwd_bwd_size: the size whose executions are forward-backwarded (must be in sizes).
    fwd_bwd_executions: how many of them (≤ executions). token_budget: soft positions per
    micro-step (gyre.trajectory.microstep.pack). seed: synthesis and trajectory-selection seed.
    model_dir: an existing checkpoint ('' = write the embedded default into a temp dir).
    """

    sizes: tuple[int, ...] = SIZES
    executions: int = 8
    reps: int = 3
    fwd_bwd_size: int = 50_000
    fwd_bwd_executions: int = 6
    token_budget: int = 16384
    seed: int = 0
    model_dir: str = ""
    builder_size: int = 700_000
    saving_size: int = 200_000

    def __post_init__(self) -> None:
        if not self.sizes or any(s < 1000 for s in self.sizes):
            raise ValueError(f"BenchConfig.sizes must be non-empty and each >= 1000, got {self.sizes}")
        if self.executions < 1 or self.reps < 1 or self.token_budget < 1:
            raise ValueError("BenchConfig.executions, reps and token_budget must be >= 1")
        if not 0 <= self.fwd_bwd_executions <= self.executions:
            raise ValueError(f"BenchConfig.fwd_bwd_executions must be in [0, executions], got {self.fwd_bwd_executions}")
        for name in ("fwd_bwd_size", "builder_size", "saving_size"):
            if getattr(self, name) not in self.sizes:
                raise ValueError(f"BenchConfig.{name} ({getattr(self, name)}) must be one of sizes {self.sizes}")


def spec_for(size: int) -> SynthSpec:
    """The synthesis spec of one size: gyre.trajectory.synth's defaults (BENCHMARKS.md's shape), system
    prompts scaled down below 50K; below 20K (smoke tests only) also fewer and shorter
    sub-agents, completions and tool results, so the executions stay near their size."""
    spec = SynthSpec(target_tokens=size, system_tokens=(min(2000, max(16, size // 25)), min(8000, max(16, size // 6))))
    if size < 20_000:
        spec = dataclasses.replace(spec, sub_agents=(0, 2), sub_agent_calls=(2, 5), task_tokens=(16, 64),
                                   completion_tokens=(16, max(32, size // 20)), tool_result_tokens=(16, max(32, size // 8)),
                                   summary_instruction_tokens=(16, 32))
    return spec


def expand_all(tree: CallTree) -> list[Trajectory]:
    """The uncapped full expansion: one trajectory per leaf, trained on every policy token of
    its path (shared prefixes repeated, so a shared token is trained once per path)."""
    ids, policy, logp, version, temp = tree.arrays()
    out = []
    for leaf in tree.leaves():
        idx = tree.path_index(leaf)
        out.append(Trajectory(execution=tree.execution, leaf=leaf, role=tree.role(leaf), input_ids=ids[idx],
                              loss_mask=policy[idx].copy(), behaviour_logprobs=logp[idx], versions=version[idx],
                              temperatures=temp[idx]))
    return out


def kept(tree: CallTree, setting: str, seed: int) -> list[Trajectory]:
    """The trajectories a setting trains for one execution (builder rng convention)."""
    if setting == "uncapped":
        return expand_all(tree)
    j_max = {"jmax1": 1, "jmax5": 5}[setting]
    return trajectories(tree, j_max=j_max, rng=random.Random(f"{seed}:{tree.execution}"))


def build_samples(calls_by_execution, seed: int) -> tuple[list[Sample], int]:
    """What the throughput figure times: trees from events → J_max = 5 samples. Returns
    (samples, distinct tokens)."""
    samples, tokens = [], 0
    for calls in calls_by_execution:
        execution = calls[0].execution
        tree = build_tree(execution, calls)
        tokens += tree.n_tokens
        ts = trajectories(tree, j_max=5, rng=random.Random(f"{seed}:{execution}"), max_staleness=1, trained_step=0)
        samples.append(Sample(execution=execution, advantage=1.0, trajectories=tuple(ts)))
    return samples, tokens


def _stats(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def _label(size: int) -> str:
    return f"{size // 1000}K" if size % 1000 == 0 else str(size)


def run_bench(cfg: BenchConfig, log=print) -> dict:
    """Run the benchmark; returns the JSON document (see the module docstring)."""
    import torch

    t_start = time.monotonic()
    notes: list[str] = []
    executions = {}
    for k, size in enumerate(cfg.sizes):
        executions[size] = [calls for calls, _ in synth_executions(cfg.executions, spec_for(size), cfg.seed * 1000 + k,
                                                                    prefix=f"s{_label(size)}-e")]
    actual = {size: sum(sum(len(c.tokens.prompt_ids) + len(c.tokens.completion_ids) for c in calls)
                        for calls in executions[size]) for size in cfg.sizes}
    log(f"synthesised {cfg.executions} executions per size: "
        + ", ".join(f"{_label(s)}: {actual[s] / cfg.executions:,.0f} tokens/execution" for s in cfg.sizes))

    # Builder throughput, repetitions interleaved over sizes.
    rates: dict[int, list[float]] = {s: [] for s in cfg.sizes}
    for _ in range(cfg.reps):
        for size in cfg.sizes:
            t0 = time.perf_counter()
            _, tokens = build_samples(executions[size], cfg.seed)
            rates[size].append(tokens / (time.perf_counter() - t0))
    log("builder: " + ", ".join(f"{_label(s)}: {statistics.median(rates[s]) / 1e6:.1f}M tokens/s" for s in cfg.sizes))

    # Trained tokens per setting and size (deterministic: computed once).
    trained: dict[int, dict[str, int]] = {}
    positions: dict[int, dict[str, int]] = {}
    trees: dict[int, list[CallTree]] = {}
    for size in cfg.sizes:
        trees[size] = [build_tree(calls[0].execution, calls) for calls in executions[size]]
        trained[size], positions[size] = {}, {}
        for setting in SETTINGS:
            ts = [t for tree in trees[size] for t in kept(tree, setting, cfg.seed)]
            trained[size][setting] = sum(t.n_trained for t in ts)
            positions[size][setting] = sum(len(t) for t in ts)

    # Forward-backward on the fwd_bwd_size executions, settings interleaved per repetition.
    fb_times: dict[str, list[float]] = {s: [] for s in SETTINGS}
    fb_trained: dict[str, int] = {}
    fb_positions: dict[str, int] = {}
    fb_run: dict[str, int] = {}
    n_fb = cfg.fwd_bwd_executions
    if n_fb:
        if n_fb < cfg.executions:
            notes.append(f"forward-backward ran on {n_fb} of the {cfg.executions} {_label(cfg.fwd_bwd_size)} executions "
                         f"(the first {n_fb} seeded) to stay within the time limit on {os.cpu_count()} cores")
        from gyre.learning.trainer import Trainer, TrainerConfig

        with tempfile.TemporaryDirectory(prefix="gyre-bench-model-") as tmp:
            model_dir = cfg.model_dir
            if not model_dir:
                from gyre.serving.model import init_model
                model_dir = str(init_model(Path(tmp) / "model"))
            # J_max settings use the trainer as configured (a prefix shared inside a micro-step is
            # run once); the uncapped expansion is defined with shared prefixes repeated, so it
            # runs every path on its own (sharing off), from the same weights.
            trainer = Trainer(model_dir, TrainerConfig())
            trainers = {"jmax1": trainer, "jmax5": trainer,
                        "uncapped": Trainer(model_dir, TrainerConfig(shared_prefix_min_tokens=0))}
            microsteps = {}
            for setting in SETTINGS:
                samples = [Sample(execution=tree.execution, advantage=1.0, trajectories=tuple(kept(tree, setting, cfg.seed)))
                           for tree in trees[cfg.fwd_bwd_size][:n_fb]]
                microsteps[setting] = pack(samples, cfg.token_budget,
                                           shared_min_tokens=trainers[setting].cfg.shared_prefix_min_tokens)
                fb_trained[setting] = sum(s.n_e for s in samples)
                fb_positions[setting] = sum(len(t) for s in samples for t in s.trajectories)
            for t in (trainer, trainers["uncapped"]):
                t.accumulate(microsteps["jmax1"][0])  # warm-up (allocator, kernels); not timed
                t.optimizer.zero_grad(set_to_none=True)
            for rep in bar(range(cfg.reps), total=cfg.reps, desc="reps"):
                # Micro-steps of the three settings round-robin, each timed on its own, so a
                # slow spell of this shared machine falls on all settings alike.
                spent = {s: 0.0 for s in SETTINGS}
                run = {s: 0.0 for s in SETTINGS}
                for k in range(max(len(m) for m in microsteps.values())):
                    for setting in SETTINGS:
                        if k < len(microsteps[setting]):
                            t0 = time.perf_counter()
                            run[setting] += trainers[setting].accumulate(microsteps[setting][k])["positions"]
                            spent[setting] += time.perf_counter() - t0
                for setting in SETTINGS:
                    fb_times[setting].append(spent[setting])
                    fb_run[setting] = int(run[setting])
                    trainers[setting].optimizer.zero_grad(set_to_none=True)
                    log(f"fwd-bwd rep {rep + 1}/{cfg.reps} {setting}: {spent[setting]:.1f}s "
                        f"({fb_positions[setting]:,} positions, {fb_run[setting]:,} run, {fb_trained[setting]:,} trained)")

    doc: dict = {"benchmark": "trajectories"}
    by = _label
    doc["trained_tokens"] = dict(trained[cfg.saving_size])
    doc["trained_tokens_by_size"] = {by(s): dict(trained[s]) for s in cfg.sizes}
    doc["forwarded_positions_by_size"] = {by(s): dict(positions[s]) for s in cfg.sizes}
    u, j5 = trained[cfg.saving_size]["uncapped"], trained[cfg.saving_size]["jmax5"]
    doc["token_saving_jmax5"] = 1.0 - j5 / u if u else 0.0
    doc["token_saving_jmax5_by_size"] = {by(s): (1.0 - trained[s]["jmax5"] / trained[s]["uncapped"]
                                                 if trained[s]["uncapped"] else 0.0) for s in cfg.sizes}
    if n_fb:
        med = {s: _stats(fb_times[s]) for s in SETTINGS}
        doc["fwd_bwd_s"] = {s: med[s][0] for s in SETTINGS}
        doc["fwd_bwd_s_min"] = {s: med[s][1] for s in SETTINGS}
        doc["fwd_bwd_s_max"] = {s: med[s][2] for s in SETTINGS}
        doc["fwd_bwd_s_by_size"] = {by(cfg.fwd_bwd_size): dict(doc["fwd_bwd_s"])}
        savings = [1.0 - a / b for a, b in zip(fb_times["jmax5"], fb_times["uncapped"])]  # per repetition
        doc["fwd_bwd_saving_jmax5"], doc["fwd_bwd_saving_jmax5_min"], doc["fwd_bwd_saving_jmax5_max"] = _stats(savings)
        doc["fwd_bwd_trained_tokens"] = fb_trained
        doc["fwd_bwd_positions"] = fb_positions
        doc["fwd_bwd_decoder_positions"] = fb_run
        doc["fwd_bwd_shared_prefix"] = {s: s != "uncapped" for s in SETTINGS}
        doc["fwd_bwd_executions"] = n_fb
        doc["fwd_bwd_positions_per_s"] = {s: fb_positions[s] / med[s][0] for s in SETTINGS}
    b = _stats(rates[cfg.builder_size])
    doc["builder_tokens_per_s"], doc["builder_tokens_per_s_min"], doc["builder_tokens_per_s_max"] = b
    doc["builder_tokens_per_s_by_size"] = {by(s): statistics.median(rates[s]) for s in cfg.sizes}
    doc["execution_tokens_by_size"] = {by(s): actual[s] / cfg.executions for s in cfg.sizes}
    doc["config"] = {"sizes": list(cfg.sizes), "executions": cfg.executions, "reps": cfg.reps,
                     "fwd_bwd_size": cfg.fwd_bwd_size, "fwd_bwd_executions": n_fb, "token_budget": cfg.token_budget,
                     "seed": cfg.seed, "model": cfg.model_dir or "embedded default (gyre.serving.model.ModelSpec())"}
    doc["targets"] = {"fwd_bwd_saving_jmax5": 0.25, "builder_tokens_per_s": 5e6}
    doc["notes"] = notes
    doc["machine"] = {"cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                      "torch_threads": torch.get_num_threads(), "platform": platform.platform()}
    doc["wall_s"] = time.monotonic() - t_start
    return doc


def format_table(doc: dict) -> str:
    """A readable table of the document."""
    lines = []
    sizes = list(doc["trained_tokens_by_size"])
    lines.append(f"{'trained tokens':<22}" + "".join(f"{s:>14}" for s in sizes))
    for setting in SETTINGS:
        lines.append(f"  {setting:<20}" + "".join(f"{doc['trained_tokens_by_size'][s][setting]:>14,}" for s in sizes))
    lines.append(f"  {'saving jmax5':<20}" + "".join(f"{doc['token_saving_jmax5_by_size'][s]:>14.3f}" for s in sizes))
    lines.append(f"{'builder tokens/s':<22}" + "".join(f"{doc['builder_tokens_per_s_by_size'][s] / 1e6:>13.1f}M" for s in sizes))
    if "fwd_bwd_s" in doc:
        size = next(iter(doc["fwd_bwd_s_by_size"]))
        lines.append(f"fwd-bwd ({size}, {doc['fwd_bwd_executions']} executions, median [min–max] s)")
        for setting in SETTINGS:
            lines.append(f"  {setting:<20}{doc['fwd_bwd_s'][setting]:>10.1f} [{doc['fwd_bwd_s_min'][setting]:.1f}–"
                         f"{doc['fwd_bwd_s_max'][setting]:.1f}]  {doc['fwd_bwd_positions'][setting]:>10,} positions "
                         f"{doc['fwd_bwd_trained_tokens'][setting]:>10,} trained")
        lines.append(f"fwd_bwd_saving_jmax5  {doc['fwd_bwd_saving_jmax5']:.3f} "
                     f"[{doc['fwd_bwd_saving_jmax5_min']:.3f}–{doc['fwd_bwd_saving_jmax5_max']:.3f}]  (target ≥ 0.25)")
    lines.append(f"token_saving_jmax5    {doc['token_saving_jmax5']:.3f}")
    lines.append(f"builder_tokens_per_s  {doc['builder_tokens_per_s'] / 1e6:.1f}M  (target ≥ 5M)")
    for note in doc["notes"]:
        lines.append(f"note: {note}")
    m = doc["machine"]
    lines.append(f"machine: {m['cores']} cores, Python {m['python']}, torch {m['torch']}; wall {doc['wall_s']:.0f}s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gyre bench trajectories", description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON to PATH")
    p.add_argument("--sizes", default=",".join(str(s) for s in SIZES), help="tokens per execution, comma-separated")
    p.add_argument("--executions", type=int, default=8, help="executions per size (default 8)")
    p.add_argument("--reps", type=int, default=3, help="repetitions (default 3)")
    p.add_argument("--fwd-bwd-executions", type=int, default=6,
                   help="executions of the smallest size to forward-backward (default 6 of 8: about 15 minutes in all on 2 cores)")
    p.add_argument("--token-budget", type=int, default=16384, help="positions per micro-step (default 16384)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="", help="checkpoint directory (default: write the embedded default)")
    a = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from handlers.daemon import configure_logging
    configure_logging("bench", level=logging.WARNING)
    try:
        sizes = tuple(sorted(int(s) for s in a.sizes.split(",") if s.strip()))
        cfg = BenchConfig(sizes=sizes, executions=a.executions, reps=a.reps, fwd_bwd_size=sizes[0],
                          fwd_bwd_executions=min(a.fwd_bwd_executions, a.executions), token_budget=a.token_budget,
                          seed=a.seed, model_dir=a.model, builder_size=sizes[-1],
                          saving_size=sizes[1] if len(sizes) > 1 else sizes[0])
    except ValueError as exc:
        print(f"gyre bench trajectories: {exc}", file=sys.stderr)
        return 2
    doc = run_bench(cfg, log=lambda line: print(line, file=sys.stderr, flush=True))
    print(format_table(doc))
    if a.json:
        Path(a.json).write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY) + b"\n")
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
