"""Recipes: overrides are typed and checked, and the `[proxy]` table reaches a run's proxy."""
import argparse

import pytest

from gyre.config import RecipeError, load_recipe


def test_a_proxy_override_reaches_the_runs_proxy_config(tmp_path):
    """The limits a deployment sets in the recipe (429 beyond `max_active_calls`, 413 beyond
    `body_limit_bytes`) are the ones its proxy enforces; they were Config fields no recipe
    could set."""
    from handlers.daemon import RunContext
    from handlers.proxy.daemon import Config, config_from_context

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    recipe = load_recipe("toy", {"model.dir": str(tmp_path / "model"), "proxy.max_active_calls": 64,
                                 "proxy.max_active_calls_per_execution": 2, "proxy.retry_after_s": 3,
                                 "proxy.body_limit_bytes": 1 << 20, "proxy.keepalive_s": 5.0})
    ctx = RunContext(run="r1", run_dir=tmp_path, recipe=recipe, nats_url="nats://127.0.0.1:1", nats_token=None,
                     key_secret=b"k" * 32)
    cfg = config_from_context(ctx, argparse.Namespace(port=0, engine_url=""))
    assert (cfg.max_active_calls, cfg.max_active_calls_per_execution, cfg.retry_after_s) == (64, 2, 3)
    assert (cfg.body_limit_bytes, cfg.keepalive_s) == (1 << 20, 5.0)
    default = config_from_context(
        RunContext(run="r1", run_dir=tmp_path, recipe=load_recipe("toy", {"model.dir": str(tmp_path / "model")}),
                   nats_url="nats://127.0.0.1:1", nats_token=None, key_secret=b"k" * 32),
        argparse.Namespace(port=0, engine_url=""))
    plain = Config(run="r1", key_secret=b"k" * 32)
    for name in ("max_active_calls", "max_active_calls_per_execution", "retry_after_s", "body_limit_bytes",
                 "retry_timeout_s", "keepalive_s", "deliver_timeout_s"):
        assert getattr(default, name) == getattr(plain, name), name  # the recipe's defaults are the proxy's


@pytest.mark.parametrize("override,message", [
    ({"proxy.max_active_calls": -1}, "proxy.max_active_calls must be >= 0"),
    ({"proxy.body_limit_bytes": 0}, "body_limit_bytes must be > 0"),
    ({"proxy.max_active_calls": "8"}, "proxy.max_active_calls must be int"),
    ({"proxy.max_calls": 8}, "unknown key proxy.max_calls"),
    ({"proxy.retry_timeout_s": float("nan")}, "retry_timeout_s must be > 0"),  # never gave up publishing
])
def test_a_bad_proxy_override_names_its_key(override, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe("toy", override)
