"""One definition per setting: each recipe table reaches the component that owns it, and
every setting is documented where it is defined."""
from __future__ import annotations

import argparse
import ast
import dataclasses
from pathlib import Path

import pytest

from gyre.config import RecipeError, fields_of, load_recipe

ROOT = Path(__file__).resolve().parents[1]
OVERRIDES = {"run.seed": 7, "run.steps": 5, "tasks.group_size": 2, "harness.concurrency": 3,
             "harness.timeout_s": 9.5, "harness.max_calls": 9, "engine.max_context_tokens": 999,
             "sampling.max_tokens": 11, "cells.count": 3, "cells.capacity": 5, "run.mode": "async",
             "run.rollout_cells": 2, "train.lr": 0.5, "train.weight_decay": 0.1,
             "train.grad_clip": 2.0, "train.eps_low": 0.2, "train.eps_high": 0.1, "train.microstep_tokens": 100,
             "train.j_max": 3, "train.max_staleness": 2}


@pytest.fixture
def ctx(tmp_path):
    from handlers.daemon import RunContext

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    recipe = load_recipe("toy", {"model.dir": str(tmp_path / "model"), **OVERRIDES})
    return RunContext(run="r1", run_dir=tmp_path, recipe=recipe, nats_url="nats://127.0.0.1:1", nats_token=None,
                      key_secret=b"k" * 32, engine_token="e" * 32)


def test_the_recipe_reaches_the_builder_and_the_scheduler(ctx):
    from handlers import builder, scheduler

    policy = builder.Builder(builder.config_from_context(ctx), bus=None).policy
    assert (policy.token_budget, policy.j_max, policy.max_staleness, policy.seed) == (100, 3, 2, 7)
    cfg = scheduler.config_from_context(ctx)
    sched = scheduler.Scheduler(cfg, bus=None, tasks=["t1", "t2"])
    p = sched.policy
    assert (p.mode, p.cfg.cells, p.cfg.capacity, p.cfg.steps, p.cfg.groups_per_step, p.cfg.group_size,
            p.cfg.staleness, p.options()) == (
        "async", ("cell0", "cell1", "cell2"), 5, 5, 2, 2, 2, {"rollout_cells": 2})
    assert sorted(sched.order) == ["t1", "t2"] and cfg.trace_path == ctx.run_dir / "trace.jsonl"
    assert (cfg.harness.name, cfg.harness.timeout_s, cfg.harness.max_calls) == ("toy", 9.5, 9)


def test_the_recipe_reaches_the_runner_and_the_cell(ctx):
    from handlers import cell, runner

    run = runner.config_from_context(ctx)
    assert (run.concurrency, run.tasks, run.context_tokens) == (3, "toy", 999)
    c = cell.config_from_context(ctx, argparse.Namespace(cell="cell1"))
    assert (c.cell, c.core, c.weights_dir) == ("cell1", False, ctx.run_dir / "weights")
    assert c.engine_token == "e" * 32
    e = c.engine
    assert (e.model_dir, e.max_context_tokens, e.max_completion_tokens, e.seed) == (str(ctx.run_dir / "model"), 999,
                                                                                     11, 7)
    t = c.trainer
    assert (t.lr, t.weight_decay, t.grad_clip, t.eps_low, t.eps_high, t.seed) == (0.5, 0.1, 2.0, 0.2, 0.1, 7)


def test_fields_of_takes_the_settings_a_component_declares(ctx):
    from gyre.learning.settings import TrainerSettings

    assert fields_of(ctx.recipe.train, TrainerSettings) == {"lr": 0.5, "weight_decay": 0.1, "grad_clip": 2.0,
                                                             "eps_low": 0.2, "eps_high": 0.1, "dtype": "float32",
                                                             "lease_s": 30.0, "grant_budget": 3, "device_time_s": 0.0,
                                                             "adam_eps": 1e-8}


def test_the_trainer_and_the_recipe_check_one_rule():
    from gyre.learning.trainer import TrainerConfig

    with pytest.raises(RecipeError, match=r"TrainSection\.eps_low must be in \(0, 1\)"):
        load_recipe("toy", {"train.eps_low": 1.5})
    with pytest.raises(ValueError, match=r"TrainerConfig\.eps_low must be in \(0, 1\)"):
        TrainerConfig(eps_low=1.5)
    with pytest.raises(RecipeError, match="max_context_tokens must be >= 1"):
        load_recipe("toy", {"engine.max_context_tokens": 0})
    with pytest.raises(RecipeError, match="HarnessSection.concurrency must be > 0"):
        load_recipe("toy", {"harness.concurrency": 0})


def _undocumented(path: Path, skip: frozenset[str] = frozenset()) -> list[str]:
    """Fields of the dataclasses in `path` with no docstring right after them."""
    missing = []
    for node in ast.parse(path.read_text()).body:
        if not isinstance(node, ast.ClassDef) or node.name in skip:
            continue
        if not any("dataclass" in ast.unparse(d) for d in node.decorator_list):
            continue
        body = node.body
        for i, stmt in enumerate(body):
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                doc = body[i + 1] if i + 1 < len(body) else None
                if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
                        and isinstance(doc.value.value, str)):
                    missing.append(f"{node.name}.{stmt.target.id}")
    return missing


def test_every_setting_is_documented_where_it_is_defined():
    # Recipe's fields are the tables, documented in the module docstring.
    assert _undocumented(ROOT / "gyre" / "config.py", frozenset({"Recipe"})) == []
    assert _undocumented(ROOT / "gyre" / "learning" / "settings.py") == []
    assert _undocumented(ROOT / "gyre" / "serving" / "settings.py") == []
    assert [n for n in _undocumented(ROOT / "gyre" / "learning" / "trainer.py") if n.startswith("TrainerConfig.")] == []
    assert [n for n in _undocumented(ROOT / "gyre" / "serving" / "engine.py") if n.startswith("EngineConfig.")] == []


def test_a_recipe_round_trips_through_its_dict():
    from gyre.config import recipe_from_dict

    recipe = load_recipe("toy", OVERRIDES)
    assert recipe_from_dict(recipe.to_dict()) == recipe
    assert dataclasses.asdict(recipe)["harness"] == {"concurrency": 3, "name": "toy", "timeout_s": 9.5,
                                                     "max_calls": 9}
