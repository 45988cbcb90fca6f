"""Harness profiles and execution keys.

A harness is an unmodified agent program. A profile says how to start it for one
execution: its command line, its environment (the proxy's base URL and the execution's
key, nothing of gyre's own), the configuration files it needs in its per-execution home,
and the host paths of its installation that must be visible (read-only) in the sandbox.

Profiles (`PROFILES`, `get_profile(name)`):
- `mini-swe-agent` (default): mini-swe-agent 2.x from PyPI, bash tool calls,
  gyre/data/harness/mini.yaml.
- `mini-swe-agent-text`: the same with `--model-class litellm_textbased` and
  gyre/data/harness/mini_textbased.yaml (commands in a ```mswea_bash_command fence).
- `toy`: gyre/data/harness/toy_harness.py, one or two chat calls, writes `answer.txt`.

Execution keys (DESIGN.md "Processes": per-execution key): `execution_key(secret, e)` =
`gyre-<e>-<first 32 hex digits of HMAC-SHA256(secret, e)>`; the proxy recovers and
checks the execution with `verify_key` (constant-time comparison).
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os
import sys
from pathlib import Path
from typing import Callable, Mapping

from gyre.tasks import DATA_DIR, Task

HARNESS_DIR = DATA_DIR / "harness"
KEY_PREFIX = "gyre-"
_MAC_HEX = 32


def execution_key(secret: bytes, execution: str) -> str:
    """The API key handed to the harness of `execution`.

    secret: the run's key secret (bytes, ≥ 16 recommended). Raises ValueError on an empty
    secret or execution id.
    """
    if not secret:
        raise ValueError("execution keys need a non-empty secret")
    if not execution:
        raise ValueError("execution id must be non-empty")
    mac = hmac.new(secret, execution.encode("utf-8"), hashlib.sha256).hexdigest()[:_MAC_HEX]
    return f"{KEY_PREFIX}{execution}-{mac}"


def verify_key(secret: bytes, key: str) -> str | None:
    """The execution id a key was issued for, or None when the key is malformed or forged."""
    if not secret or not key.startswith(KEY_PREFIX):
        return None
    execution, sep, mac = key[len(KEY_PREFIX):].rpartition("-")
    if not sep or not execution or len(mac) != _MAC_HEX:
        return None
    expected = hmac.new(secret, execution.encode("utf-8"), hashlib.sha256).hexdigest()[:_MAC_HEX]
    return execution if hmac.compare_digest(expected, mac) else None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LaunchRequest:
    """What a profile needs to start one execution.

    workspace: the execution's workspace (cwd; graded afterwards).
    home: a per-execution writable directory outside the workspace (HOME, configs,
      the harness's own trajectory/log files).
    proxy_url: the proxy's base URL without `/v1`, e.g. `http://127.0.0.1:8400`.
    api_key: the execution's key (`execution_key`). model: model name sent to the proxy.
    max_calls: cap on model calls (0 = none); profiles pass it on where the harness has one.
    python: interpreter of the harness environment (a venv readable by the sandbox uid).
    """

    execution: str
    task: Task
    workspace: Path
    home: Path
    proxy_url: str
    api_key: str
    model: str
    max_calls: int = 0
    python: str = sys.executable


@dataclasses.dataclass(frozen=True, slots=True)
class HarnessCommand:
    """How to start a harness.

    argv: command line. env: harness variables (added to the sandbox's base environment).
    files: files to write into `home` first (relative path → text).
    readonly: host paths of the installation to expose read-only in the sandbox.
    path_dirs: directories to put first on PATH.
    """

    argv: list[str]
    env: dict[str, str]
    files: dict[str, str]
    readonly: tuple[str, ...]
    path_dirs: tuple[str, ...] = ()


Profile = Callable[[LaunchRequest], HarnessCommand]


def python_installation(python: str) -> tuple[str, ...]:
    """Host paths a sandbox must show for `python` to run: its venv (or prefix) and the
    base installation it was created from, when that lives outside /usr."""
    exe = Path(python)
    venv = exe.parent.parent
    paths = [str(venv)]
    cfg = venv / "pyvenv.cfg"
    if cfg.is_file():
        for line in cfg.read_text().splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "home":
                base = Path(value.strip()).parent
                if not str(base).startswith("/usr"):
                    paths.append(str(base))
    real = Path(os.path.realpath(exe)).parent.parent
    if not str(real).startswith("/usr") and str(real) not in paths:
        paths.append(str(real))
    return tuple(paths)


def _mini(req: LaunchRequest, *, textbased: bool) -> HarnessCommand:
    config = "mini_textbased.yaml" if textbased else "mini.yaml"
    bindir = Path(req.python).parent
    argv = [str(bindir / "mini"), "-y", "--exit-immediately", "-t", req.task.problem_statement,
            "-m", f"openai/{req.model}"]
    if textbased:
        argv += ["--model-class", "litellm_textbased"]
    argv += ["-c", str(req.home / config), "-c", f"model.model_kwargs.api_base={req.proxy_url.rstrip('/')}/v1",
             "-c", f"environment.cwd={req.workspace}"]
    if req.max_calls > 0:
        argv += ["-c", f"agent.step_limit={req.max_calls}"]
    argv += ["-o", str(req.home / "traj.json")]
    env = {
        "MSWEA_CONFIGURED": "true",
        "MSWEA_COST_TRACKING": "ignore_errors",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "MSWEA_SILENT_STARTUP": "1",
        "MSWEA_GLOBAL_CONFIG_DIR": str(req.home / ".config" / "mini-swe-agent"),
        "OPENAI_API_KEY": req.api_key,
        "HF_HUB_OFFLINE": "1",
        "NO_COLOR": "1",
    }
    return HarnessCommand(argv=argv, env=env, files={config: (HARNESS_DIR / config).read_text()},
                          readonly=python_installation(req.python), path_dirs=(str(bindir),))


def mini_swe_agent(req: LaunchRequest) -> HarnessCommand:
    """mini-swe-agent, bash tool-call variant (HARNESSES.md "mini-swe-agent")."""
    return _mini(req, textbased=False)


def mini_swe_agent_text(req: LaunchRequest) -> HarnessCommand:
    """mini-swe-agent, text-based variant (`litellm_textbased`)."""
    return _mini(req, textbased=True)


def toy(req: LaunchRequest) -> HarnessCommand:
    """The toy harness: one or two chat calls, the last answer written to answer.txt."""
    calls = 2 if req.max_calls <= 0 else min(2, req.max_calls)
    argv = [req.python, str(req.home / "toy_harness.py"), "--task-file", str(req.home / "task.md"),
            "--model", req.model, "--calls", str(calls)]
    env = {"OPENAI_BASE_URL": f"{req.proxy_url.rstrip('/')}/v1", "OPENAI_API_KEY": req.api_key}
    files = {"toy_harness.py": (HARNESS_DIR / "toy_harness.py").read_text(), "task.md": req.task.problem_statement}
    return HarnessCommand(argv=argv, env=env, files=files, readonly=python_installation(req.python))


PROFILES: Mapping[str, Profile] = {
    "mini-swe-agent": mini_swe_agent,
    "mini-swe-agent-text": mini_swe_agent_text,
    "toy": toy,
}
DEFAULT_PROFILE = "mini-swe-agent"


def get_profile(name: str) -> Profile:
    """The profile called `name`. Raises KeyError naming the known profiles."""
    try:
        return PROFILES[name]
    except KeyError:
        raise KeyError(f"unknown harness profile {name!r}; known: {sorted(PROFILES)}") from None
