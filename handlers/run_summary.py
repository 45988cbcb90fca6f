"""What `gyre run` prints when a run ends: its summary, the reward curve, and notes on what
the figures suggest (refused calls, harnesses that failed, steps with nothing to train)."""
from __future__ import annotations

from handlers.run_cells import print_cells


def print_summary(s: dict) -> None:
    """Print `gyre run`'s summary (summary.json's dict, with `outcome`) and what it suggests."""
    print("\n== gyre run summary ==")
    print(f"run              {s['run']}   outcome {s['outcome']}")
    print(f"steps            {s['steps']}   executions {s['executions']} {s['executions_by_status']}")
    print(f"calls            {s['calls']} {s['calls_by_status']}   by policy version {s['calls_by_policy_version']}")
    print(f"reward per step  {[None if r is None else round(r, 3) for r in s['rewards_per_step']]}")
    print(f"tokens trained   {s['tokens_trained']}")
    print(f"zero-var groups  {s['zero_variance_groups']}")
    print(f"grad norm        {[round(g, 5) for g in s['grad_norm_per_step']]}")
    print_curve(s)
    print(f"policy version   {s['policy_version']}   mode {s.get('mode')} on {s.get('cells')} cell(s)")
    print_cells(s)
    print(f"wall             {s['wall_s']} s")
    failed = {k: v for k, v in s["executions_by_status"].items() if k != "ok"}
    refused = s["calls_by_status"].get("error", 0)
    if refused:
        print(f"note             {refused} model calls were refused or failed (never trained): the proxy's reasons are\n"
              f"                 `proxy.call.failed` lines in runs/{s['run']}/logs/proxy.log (a prompt beyond\n"
              "                 engine.max_context_tokens is answered \"prompt is too long\")")
    if s["executions_exit_nonzero"]:
        print(f"note             {s['executions_exit_nonzero']} of {s['executions']} harnesses exited with a non-zero code "
              f"(scored as they\n                 left their workspace): see runs/{s['run']}/logs/executions/")
    if s.get("executions_without_calls"):
        print(f"note             {s['executions_without_calls']} of {s['executions']} executions made no model "
              f"call (scored, never trained):\n                 did their harness reach the proxy? See "
              f"runs/{s['run']}/logs/executions/")
    if failed:
        print(f"note             executions that did not finish ok: {failed}; their reasons are in\n"
              f"                 runs/{s['run']}/logs/runner.log and logs/executions/")
    elif s["steps"] and s["tokens_trained"] == 0 and s.get("evaluator") == "external":
        print("note             every group had zero reward variance (rewards from your reward service), so\n"
              "                 GSPO had nothing to push.")
    elif s["steps"] and s["tokens_trained"] == 0 and s.get("group_size") == 1:
        print("note             every group holds one execution (tasks.group_size = 1): its advantage is 0, so\n"
              "                 GSPO had nothing to push; set tasks.group_size to 2 or more.")
    elif s["steps"] and s["tokens_trained"] == 0:
        print("note             every group had zero reward variance, so GSPO had nothing to push: a random\n"
              "                 policy scores alike on every execution of a task. `gyre run toy` grades\n"
              "                 properties of a single answer, so rewards differ and a step has a gradient.")


def print_curve(s: dict) -> None:
    """The reward curve, one line per step with its gradient norm (a bar of 40 = reward 1)."""
    grads = s["grad_norm_per_step"]
    if len(s["rewards_per_step"]) < 2:
        return
    print("reward curve     step  reward  grad norm")
    for k, r in enumerate(s["rewards_per_step"]):
        g = f"{grads[k]:9.4f}" if k < len(grads) else "        -"
        bar = "" if r is None else "#" * round(40 * max(0.0, min(1.0, r)))
        print(f"                 {k:4d}  {'   -  ' if r is None else f'{r:6.3f}'}  {g}  {bar}")
