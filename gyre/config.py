"""Recipes: the typed configuration of one training run.

A recipe is a TOML file (bundled recipes live in `gyre/recipes/<name>.toml` and are
found by name). Each table maps onto one frozen dataclass below; every field has a
docstring-style comment with its unit, and `__post_init__` names the broken rule.
Unknown keys are an error (a typo must not silently fall back to a default).

    recipe = load_recipe("quickstart")           # bundled name or path to a .toml
    recipe.to_dict()                             # resolved, JSON-serialisable
"""
from __future__ import annotations

import dataclasses
import tomllib
import typing
from pathlib import Path
from typing import Any, Literal

RECIPES_DIR = Path(__file__).parent / "recipes"

Mode = Literal["colocate", "elastic", "colocate_overlapped", "async", "async_nonstreaming"]


class RecipeError(ValueError):
    """A recipe could not be found, parsed or validated; the message names the key."""


def _positive(obj: Any, *names: str) -> None:
    for name in names:
        if not getattr(obj, name) > 0:  # NaN too: it compares false both ways
            raise RecipeError(f"{type(obj).__name__}.{name} must be > 0, got {getattr(obj, name)!r}")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RunSection:
    name: str = "run"  # label shown in progress and summary
    seed: int = 0  # seeds task order, sampling and trajectory selection
    steps: int = 2  # optimizer steps (= bursts) to run
    mode: Mode = "colocate"  # scheduling policy (DESIGN.md "Elastic scheduling")

    def __post_init__(self) -> None:
        _positive(self, "steps")
        if self.mode != "colocate":
            raise RecipeError(f"run.mode {self.mode!r} is not implemented yet; use 'colocate'")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TasksSection:
    set: str = "quickstart"  # bundled task set name or path to a JSONL file
    groups_per_step: int = 3  # tasks (= groups) per step
    group_size: int = 4  # G, executions per task per step

    def __post_init__(self) -> None:
        _positive(self, "groups_per_step", "group_size")
        from gyre.env.tasks import TaskError, load_tasks
        try:
            load_tasks(self.set)
        except (TaskError, OSError) as exc:
            raise RecipeError(f"tasks.set {self.set!r}: {exc}") from None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class HarnessSection:
    name: str = "mini-swe-agent"  # harness profile (gyre.env.harness)
    timeout_s: float = 120.0  # wall-clock limit of one execution, seconds
    max_calls: int = 8  # model calls the proxy serves one execution (0 = no cap)
    concurrency: int = 16  # executions running at once on this runner

    def __post_init__(self) -> None:
        _positive(self, "timeout_s", "concurrency")
        from gyre.env.harness import PROFILES
        if self.name not in PROFILES:
            raise RecipeError(f"harness.name {self.name!r} is not a harness profile; known: {sorted(PROFILES)}")
        if self.max_calls < 0:
            raise RecipeError("harness.max_calls must be >= 0 (0 = no cap)")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ModelSection:
    dir: str = ""  # existing HF checkpoint; '' = `gyre init-model` into the run directory
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        _positive(self, "layers", "hidden", "heads", "kv_heads")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SamplingSection:
    temperature: float = 1.0  # behaviour and trainer log-probs use logits / temperature
    top_p: float = 1.0  # 1 = off (training default, DESIGN.md "Learning")
    top_k: int = -1  # -1 = off
    max_tokens: int = 64  # cap on completion tokens per call, whatever the harness asks

    def __post_init__(self) -> None:
        _positive(self, "temperature", "max_tokens")
        if not 0.0 < self.top_p <= 1.0:
            raise RecipeError(f"sampling.top_p must be in (0, 1], got {self.top_p}")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class EngineSection:
    # prompt + completion window of the policy: the embedded engine's cap, and the proxy's (a prompt
    # that leaves no room gets the API's prompt-too-long error; completions are capped at the room left)
    max_context_tokens: int = 32768

    def __post_init__(self) -> None:
        _positive(self, "max_context_tokens")


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
class TrainSection:
    lr: float = 1e-3  # AdamW learning rate
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # global L2 norm clip
    eps_low: float = 3e-4  # GSPO clip range (Zheng et al. 2025)
    eps_high: float = 4e-4
    microstep_tokens: int = 16384  # soft budget of distinct token positions in one micro-step
    j_max: int = 5  # trajectories kept per execution (DESIGN.md "Trajectory processing")
    max_staleness: int = 1  # S: tokens older than this many versions are masked

    def __post_init__(self) -> None:
        _positive(self, "lr", "grad_clip", "eps_low", "eps_high", "microstep_tokens", "j_max")
        if self.weight_decay < 0:
            raise RecipeError("train.weight_decay must be >= 0")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CellsSection:
    count: int = 1  # cells; the first is the core cell

    def __post_init__(self) -> None:
        _positive(self, "count")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Recipe:
    run: RunSection = RunSection()
    tasks: TasksSection = TasksSection()
    harness: HarnessSection = HarnessSection()
    model: ModelSection = ModelSection()
    sampling: SamplingSection = SamplingSection()
    engine: EngineSection = EngineSection()
    proxy: ProxySection = ProxySection()
    train: TrainSection = TrainSection()
    cells: CellsSection = CellsSection()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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
