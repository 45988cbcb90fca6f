"""`gyre run`'s summary counts what a user needs to notice a broken run."""
from __future__ import annotations

import schemas
from gyre.config import load_recipe
from handlers.run import Progress, _print_summary


def _finished(execution: str) -> schemas.ExecutionFinished:
    info = schemas.ExecutionInfo(execution=execution, task="t", group="s0-g0", step=0, harness="toy",
                                 group_size=2, step_groups=1)
    return schemas.ExecutionFinished(event_id=f"r:{execution}:finished", info=info, status="ok",
                                     workspace="/nonexistent", exit_code=1, duration_s=0.5)


def _call(execution: str, seq: int = 0, status: str = "ok") -> schemas.CallCompleted:
    return schemas.CallCompleted(event_id=f"r:{execution}:call:{seq}", call=f"{execution}:{seq}", execution=execution,
                                 seq=seq, parent_call=None, prefix_len=0, tokens=schemas.CallTokens(),
                                 sampling=schemas.SamplingParams(), finish_reason="stop" if status == "ok" else "error",
                                 versions=(), cell="c", role="main", api="chat", status=status, timings={}, drift=0,
                                 meta={})


async def test_executions_that_never_called_the_model_are_counted_and_named(tmp_path, capsys):
    """A harness that could not reach the proxy finishes `ok` (it ran) and scores 0: the
    summary says how many executions made no call, so the run does not look healthy."""
    progress = Progress(load_recipe("toy"), tmp_path / "metrics.jsonl")
    for event in (_finished("s0-g0-e0"), _call("s0-g0-e0"), _finished("s0-g0-e1"), _finished("s0-g0-e2")):
        await progress.on_event(event)
    summary = {**progress.summary("r", 1.0), "outcome": "done"}
    assert summary["executions_without_calls"] == 2 and summary["calls"] == 1
    _print_summary(summary)
    out = capsys.readouterr().out
    assert "2 of 3 executions made no model call" in out and "runs/r/logs/executions/" in out
    progress.metrics.close()


async def test_refused_calls_and_failed_harnesses_are_counted_and_named(tmp_path, capsys):
    """A run whose prompts outgrew the context finished `done` with every execution `ok`
    (their harnesses ran, then exited 1 on the refusal): the summary says so."""
    progress = Progress(load_recipe("toy"), tmp_path / "metrics.jsonl")
    for event in (_call("s0-g0-e0"), _call("s0-g0-e0", 1, "error"), _finished("s0-g0-e0")):
        await progress.on_event(event)
    summary = {**progress.summary("r", 1.0), "outcome": "done"}
    assert summary["calls_by_status"] == {"error": 1, "ok": 1} and summary["executions_exit_nonzero"] == 1
    _print_summary(summary)
    out = capsys.readouterr().out
    assert "1 model calls were refused or failed" in out and "runs/r/logs/proxy.log" in out
    assert "1 of 1 harnesses exited with a non-zero code" in out
    progress.metrics.close()


async def test_a_run_of_groups_of_one_is_told_why_nothing_was_trained(tmp_path, capsys):
    """With one execution per group every advantage is 0: the note names the group size,
    not the random policy."""
    recipe = load_recipe("toy", {"tasks.group_size": 1})
    progress = Progress(recipe, tmp_path / "metrics.jsonl")
    summary = {**progress.summary("r", 1.0), "outcome": "done", "steps": 1, "tokens_trained": 0}
    _print_summary(summary)
    out = capsys.readouterr().out
    assert "tasks.group_size = 1" in out and "random" not in out
    progress.metrics.close()


async def test_a_run_stopped_early_lists_rewards_for_the_steps_it_reached_only(tmp_path):
    """Ctrl-C after step 0 of 30: `rewards_per_step` holds step 0, not 29 Nones besides."""
    progress = Progress(load_recipe("toy", {"run.steps": 30}), tmp_path / "metrics.jsonl")
    assert progress.summary("r", 1.0)["rewards_per_step"] == []
    progress.rewards[0] = {"s0-g0-e0": 1.0, "s0-g0-e1": 0.0}
    assert progress.summary("r", 1.0)["rewards_per_step"] == [0.5]
    progress.metrics.close()
