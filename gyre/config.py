"""Recipes: the typed configuration of one training run.

A recipe is a TOML file (bundled recipes live in `gyre/recipes/<name>.toml` and are
found by name). Each table maps onto one frozen dataclass (`Recipe` composes them);
every field has a docstring with its meaning and unit, and `__post_init__` raises
RecipeError naming the broken rule. Unknown keys and values of the wrong type are an
error too (a typo must not silently fall back to a default).

Each setting is defined once. A table whose settings a component owns is, or extends,
that component's settings class (`*Settings`), and the component's own config extends
the same class, so it is built from the table with `fields_of`:

    [run]      RunSection
    [tasks]    TasksSection
    [harness]  HarnessSection   = RunnerSettings (the runner's) + the executions' harness and limits
    [model]    ModelSection
    [sampling] SamplingSection
    [engine]   EngineSection    = gyre.serving.settings.EngineSettings (gyre.serving.engine.EngineConfig
                                  extends it) + which engine a cell hosts
    [proxy]    ProxySection
    [train]    TrainSection     = gyre.learning.settings.TrainerSettings (TrainerConfig extends
                                  it) + the builder's trajectory selection and packing
    [cells]    CellsSection

    recipe = load_recipe("quickstart")           # bundled name or path to a .toml
    recipe.to_dict()                             # resolved, JSON-serialisable
    recipe_keys()                                # every key: what docs/recipes.md documents

Imports stay light (no torch): the daemons, `gyre run` and the simulator load recipes.
"""
from __future__ import annotations

import dataclasses
import tomllib
import typing
from pathlib import Path
from typing import Any, Literal

from gyre.learning.settings import TrainerSettings
from gyre.serving.settings import EngineSettings

RECIPES_DIR = Path(__file__).parent / "recipes"

Mode = Literal["colocate", "elastic", "colocate_overlapped", "async", "async_nonstreaming"]
ReturnRule = Literal["adaptive", "boundary", "idle"]


class RecipeError(ValueError):
    """A recipe could not be found, parsed or validated; the message names the key."""


def _positive(obj: Any, *names: str) -> None:
    for name in names:
        if not getattr(obj, name) > 0:  # NaN too: it compares false both ways
            raise RecipeError(f"{type(obj).__name__}.{name} must be > 0, got {getattr(obj, name)!r}")


def fields_of(section: Any, cls: type) -> dict[str, Any]:
    """The values in `section` of the fields `cls` declares (`section` is a `cls` or extends
    it): how a component's config is built from the recipe table that carries its
    settings, e.g. `TrainerConfig(**fields_of(recipe.train, TrainerSettings), seed=...)`."""
    return {f.name: getattr(section, f.name) for f in dataclasses.fields(cls)}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RunSection:
    """[run]: what the run is called, how long it runs and how it is scheduled."""

    name: str = "run"
    """Label of the run, shown in progress and summary; a generated run id starts with it."""
    seed: int = 0
    """Seeds task order, sampling, trajectory selection and the trainer."""
    steps: int = 2
    """Optimizer steps (= bursts) to run, > 0."""
    mode: Mode = "colocate"
    """Scheduling policy (DESIGN.md "Elastic scheduling"; gyre.control.modes.make_policy)."""
    rollout_cells: int = 0
    """The async modes' fixed split: cells that roll out, the others (core first) train;
    0 = half the cells, rounded down, at least one. Ignored by the other modes."""
    return_rule: ReturnRule = "adaptive"
    """The elastic mode's return rule (gyre.control.elastic). Ignored by the other modes."""

    def __post_init__(self) -> None:
        _positive(self, "steps")
        if self.rollout_cells < 0:
            raise RecipeError(f"run.rollout_cells must be >= 0 (0 = half the cells), got {self.rollout_cells}")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TasksSection:
    """[tasks]: the task set and how many of its tasks a step takes."""

    set: str = "quickstart"
    """Bundled task set name or path to a JSONL file (gyre.env.tasks); it must load."""
    groups_per_step: int = 3
    """Tasks (= groups) per step, > 0."""
    group_size: int = 4
    """G: executions per task per step, > 0."""

    def __post_init__(self) -> None:
        _positive(self, "groups_per_step", "group_size")
        from gyre.env.tasks import TaskError, load_tasks
        try:
            load_tasks(self.set)
        except (TaskError, OSError) as exc:
            raise RecipeError(f"tasks.set {self.set!r}: {exc}") from None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RunnerSettings:
    """The runner's settings (handlers.runner.Config extends them)."""

    concurrency: int = 16
    """Executions running at once on one runner (each a confined harness process), > 0."""

    def __post_init__(self) -> None:
        _positive(self, "concurrency")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class HarnessSection(RunnerSettings):
    """[harness]: the harness every execution runs and the limits the scheduler gives each
    execution, plus the runner's concurrency (`RunnerSettings`)."""

    name: str = "mini-swe-agent"
    """Harness profile (gyre.env.harness.PROFILES)."""
    timeout_s: float = 120.0
    """Wall-clock limit of one execution, seconds, > 0."""
    max_calls: int = 8
    """Model calls the proxy serves one execution, >= 0 (0 = no cap)."""

    def __post_init__(self) -> None:
        RunnerSettings.__post_init__(self)  # explicit: zero-argument super() fails in a slotted dataclass
        _positive(self, "timeout_s")
        from gyre.env.harness import PROFILES
        if self.name not in PROFILES:
            raise RecipeError(f"harness.name {self.name!r} is not a harness profile; known: {sorted(PROFILES)}")
        if self.max_calls < 0:
            raise RecipeError("harness.max_calls must be >= 0 (0 = no cap)")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ModelSection:
    """[model]: the policy's checkpoint, or the sizes of the embedded default model that
    `gyre run` writes (gyre.serving.model.ModelSpec with head_dim = hidden / heads and
    intermediate = 3 · hidden)."""

    dir: str = ""
    """An existing HF checkpoint directory; '' = `gyre init-model` into the run directory."""
    layers: int = 2
    """Decoder layers of the default model, > 0."""
    hidden: int = 64
    """Residual width of the default model, > 0."""
    heads: int = 4
    """Query heads of the default model, > 0."""
    kv_heads: int = 2
    """Key/value heads of the default model (grouped-query attention), > 0."""
    seed: int = 0
    """torch seed of the default model's weight initialisation."""
    warm_start: str = ""
    """Task family (gyre.learning.warm_start.FAMILIES) of a supervised warm start of the
    default model, '' = none (the random initialisation)."""
    warm_start_steps: int = 200
    """Steps of that warm start (32 pairs each), >= 0."""

    def __post_init__(self) -> None:
        _positive(self, "layers", "hidden", "heads", "kv_heads")
        if self.warm_start:
            from gyre.learning.warm_start import FAMILIES
            if self.warm_start not in FAMILIES:
                raise RecipeError(f"model.warm_start {self.warm_start!r} is not a task family; known: {list(FAMILIES)}")
        if self.warm_start_steps < 0:
            raise RecipeError(f"model.warm_start_steps must be >= 0, got {self.warm_start_steps}")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SamplingSection:
    """[sampling]: how the proxy asks the engine to sample every call."""

    temperature: float = 1.0
    """Sampling temperature, > 0; behaviour and trainer log-probs use logits / temperature."""
    top_p: float = 1.0
    """Nucleus mass, in (0, 1]; 1 = off (the training default, DESIGN.md "Learning")."""
    top_k: int = -1
    """Top-k cut; -1 = off."""
    max_tokens: int = 64
    """Cap on completion tokens per call whatever the harness asks, > 0 (the proxy's and the
    embedded engine's `max_completion_tokens`)."""

    def __post_init__(self) -> None:
        _positive(self, "temperature", "max_tokens")
        if not 0.0 < self.top_p <= 1.0:
            raise RecipeError(f"sampling.top_p must be in (0, 1], got {self.top_p}")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ProxySection:
    """The run's proxy: its limits and timeouts, the `[proxy]` table. Each setting is
    defined and validated here only: `handlers.proxy.daemon.Config` inherits these fields
    and adds the run's wiring. Durations in seconds, sizes in bytes."""

    max_active_calls: int = 0
    """Model calls admitted at once (queued or generating); beyond → 429. 0 = no cap."""
    max_active_calls_per_execution: int = 0
    """The same bound per execution (per key); 0 = no cap."""
    retry_after_s: int = 1
    """`Retry-After` seconds on a 429."""
    body_limit_bytes: int = 64 * 1024 * 1024
    """Largest request body, as sent and once decoded; beyond → 413."""
    retry_timeout_s: float = 600.0
    """How long a call waits and retries for a rollout engine before failing with 503, and
    a `call.completed` is retried before it is spilled (at most
    `handlers.proxy.outbox.PUBLISH_RETRY_MAX_S`)."""
    keepalive_s: float = 15.0
    """Seconds between keep-alives to a harness whose call waits."""
    deliver_timeout_s: float = 120.0
    """How long a harness may go without taking any of its answer once it is sent (checked
    every quarter of it, so the cut comes 1–1.25 × this after its last read). One that
    stops reading (a stalled client with an answer larger than the sockets hold) has its
    connection cut, and the call is recorded `aborted` (never trained) instead of holding
    its handler, and its execution's slot, until the proxy stops; one that reads slowly but
    steadily is never cut."""

    def __post_init__(self) -> None:
        _positive(self, "retry_after_s", "body_limit_bytes", "retry_timeout_s", "keepalive_s", "deliver_timeout_s")
        for name in ("max_active_calls", "max_active_calls_per_execution"):
            if getattr(self, name) < 0:
                raise RecipeError(f"proxy.{name} must be >= 0 (0 = no cap), got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class EngineSection(EngineSettings):
    """[engine]: the policy's context window (`EngineSettings`) and which engine each cell
    hosts behind its HTTP server (gyre.serving.host.EngineHost)."""

    kind: Literal["embedded", "scripted"] = "embedded"
    """`embedded`: the HF model of `model.dir` (gyre.serving.engine); `scripted`: the scripted
    engine (handlers.engines.scripted) answering from `script`, for tests of real harnesses
    that a random model cannot drive."""
    script: str = ""
    """The scripted engine's JSONL file (completion texts, or playbook rules); required when
    `kind` is `scripted`. A relative path is taken from the directory gyre runs in."""

    def __post_init__(self) -> None:
        EngineSettings.__post_init__(self)
        if self.kind == "scripted" and not self.script:
            raise RecipeError("engine.script must name a script or playbook file when engine.kind is 'scripted'")
        if self.script and self.kind != "scripted":
            raise RecipeError(f"engine.script is read only by the scripted engine; engine.kind is {self.kind!r}")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TrainSection(TrainerSettings):
    """[train]: the trainer's settings (`TrainerSettings`: lr, weight_decay, grad_clip,
    eps_low, eps_high) and the builder's: which trajectories are kept and how they are
    packed into micro-steps (gyre.trajectory.builder)."""

    microstep_tokens: int = 16384
    """Soft budget of distinct token positions in one micro-step (gyre.trajectory.microstep.pack), > 0."""
    j_max: int = 5
    """Trajectories kept per execution (DESIGN.md "Trajectory processing"), > 0."""
    max_staleness: int = 1
    """S: a token sampled more than this many policy versions before the trained one is masked."""

    def __post_init__(self) -> None:
        TrainerSettings.__post_init__(self)
        _positive(self, "microstep_tokens", "j_max")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CellsSection:
    """[cells]: the processes that hold an engine or a trainer replica."""

    count: int = 1
    """Cells, > 0; their ids are `ids`."""
    capacity: int = 16
    """C_e: executions one rollout cell serves at once; the scheduler dispatches no more to it, > 0."""
    transfer: Literal["loopback", "mooncake"] = "loopback"
    """How weight snapshots and gradient sums move between cells (DESIGN.md "Weight
    publication"): `loopback` (a TCP socket on 127.0.0.1) or `mooncake` (Mooncake's transfer
    engine; it binds every interface, so it runs only inside a private network namespace
    unless `transfer_cluster` is set)."""
    transfer_protocol: Literal["tcp", "rdma"] = "tcp"
    """Mooncake's transport: `tcp` on CPU, `rdma` on a cluster."""
    transfer_cluster: bool = False
    """This is a cluster whose interfaces Mooncake may bind (outside a private namespace)."""

    def __post_init__(self) -> None:
        _positive(self, "count", "capacity")

    @property
    def ids(self) -> tuple[str, ...]:
        """cell0 … cell<count − 1>, in switch order; cell0 is the core cell (it owns the optimizer state)."""
        return tuple(f"cell{i}" for i in range(self.count))


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Recipe:
    """One training run's configuration: one section per recipe table (see the module docstring)."""

    run: RunSection = RunSection()
    tasks: TasksSection = TasksSection()
    harness: HarnessSection = HarnessSection()
    model: ModelSection = ModelSection()
    sampling: SamplingSection = SamplingSection()
    engine: EngineSection = EngineSection()
    proxy: ProxySection = ProxySection()
    train: TrainSection = TrainSection()
    cells: CellsSection = CellsSection()

    def __post_init__(self) -> None:
        if self.run.mode in ("async", "async_nonstreaming"):
            if self.cells.count < 2:
                raise RecipeError(f"run.mode {self.run.mode!r} trains and rolls out on separate cells: it needs "
                                  f"cells.count >= 2, got {self.cells.count}")
            if self.run.rollout_cells >= self.cells.count:
                raise RecipeError(f"run.rollout_cells must leave a cell to train: < cells.count "
                                  f"({self.cells.count}), got {self.run.rollout_cells}")

    @property
    def rollout_cells(self) -> int:
        """The async split's rollout cells (`run.rollout_cells`, 0 = half the cells, at least one)."""
        return self.run.rollout_cells or max(1, self.cells.count // 2)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def recipe_keys() -> list[tuple[str, Any, Any]]:
    """Every recipe key as `(table.key, type hint, default)`, tables in `Recipe`'s order and
    keys in their section's field order (inherited settings first). docs/recipes.md
    documents each one; tests/test_docs.py holds the page to this list."""
    keys = []
    for table, cls in typing.get_type_hints(Recipe).items():
        hints = typing.get_type_hints(cls)
        keys += [(f"{table}.{f.name}", hints[f.name], f.default) for f in dataclasses.fields(cls)]
    return keys


def recipe_from_dict(data: dict[str, Any]) -> Recipe:
    """Build a Recipe from nested dicts; raises RecipeError on unknown or bad keys."""
    hints = typing.get_type_hints(Recipe)
    sections = {}
    for key, value in data.items():
        if key not in hints:
            raise RecipeError(f"unknown recipe table [{key}]; known: {sorted(hints)}")
        if not isinstance(value, dict):
            raise RecipeError(f"[{key}] must be a table")
        cls = hints[key]
        fields = {f.name for f in dataclasses.fields(cls)}
        field_hints = typing.get_type_hints(cls)
        for k, v in value.items():
            if k not in fields:
                raise RecipeError(f"unknown key {key}.{k}; known: {sorted(fields)}")
            _check_type(f"{key}.{k}", v, field_hints[k])
        try:
            sections[key] = cls(**value)
        except TypeError as exc:
            raise RecipeError(f"[{key}]: {exc}") from None
        except RecipeError:
            raise
        except ValueError as exc:  # a component's settings (gyre.*.settings) name the rule themselves
            raise RecipeError(str(exc)) from None
    return Recipe(**sections)


def _check_type(name: str, value: Any, hint: Any) -> None:
    """A recipe value must have its field's type (TOML gives int, float, str, bool)."""
    if typing.get_origin(hint) is Literal:
        if value not in typing.get_args(hint):
            raise RecipeError(f"{name} must be one of {list(typing.get_args(hint))}, got {value!r}")
        return
    ok = {
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
        bool: isinstance(value, bool),
    }.get(hint, True)
    if not ok:
        raise RecipeError(f"{name} must be {getattr(hint, '__name__', hint)}, got {value!r}")


def load_recipe(name_or_path: str | Path, overrides: dict[str, Any] | None = None) -> Recipe:
    """Load a bundled recipe by name or a TOML file by path; apply dotted overrides.

    overrides: {"run.steps": 3, ...}. Raises RecipeError (not found, bad TOML, bad key).
    """
    path = Path(name_or_path)
    if not path.suffix:
        bundled = RECIPES_DIR / f"{name_or_path}.toml"
        if bundled.exists():
            path = bundled
    if not path.exists():
        known = sorted(p.stem for p in RECIPES_DIR.glob("*.toml"))
        raise RecipeError(f"recipe {str(name_or_path)!r} not found (bundled: {known})")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise RecipeError(f"{path}: {exc}") from None
    for dotted, value in (overrides or {}).items():
        table, _, key = dotted.partition(".")
        if not key:
            raise RecipeError(f"override {dotted!r} must look like table.key")
        data.setdefault(table, {})[key] = value
    return recipe_from_dict(data)
