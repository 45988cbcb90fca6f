"""Harness profiles and execution keys.

A harness is an unmodified agent program. A profile says how to start it for one
execution: its command line, its environment (the proxy's base URL and the execution's
key, nothing of gyre's own), the configuration files it needs in its per-execution home,
and the host paths of its installation that must be visible (read-only) in the sandbox.

Profiles (`PROFILES`, `get_profile(name)`):
- `mini-swe-agent` (default): mini-swe-agent 2.x from PyPI, bash tool calls,
  gyre/env/data/harness/mini.yaml.
- `mini-swe-agent-text`: the same with `--model-class litellm_textbased` and
  gyre/env/data/harness/mini_textbased.yaml (commands in a ```mswea_bash_command fence).
- `toy`: gyre/env/data/harness/toy_harness.py, one or two chat calls, writes `answer.txt`.
- `synthetic`: gyre/env/data/harness/synthetic_harness.py, chat calls with think times
  whose execution lasts as long as a seeded workload says (`gyre bench modes`); the
  workload is the task's starting file `workload.json` (task set `synthetic`).
- `claude-code`: Claude Code (npm `@anthropic-ai/claude-code`, CLAUDE_CODE_VERSION),
  headless `claude -p`, Anthropic Messages against the proxy (HARNESSES.md).
- `codex`: Codex CLI (npm `@openai/codex`, CODEX_VERSION), `codex exec`, OpenAI
  Responses through a custom provider in `$CODEX_HOME/config.toml`
  (gyre/env/data/harness/codex_config.toml).

The npm harnesses live under `harness_prefix()` (`$GYRE_HARNESS_PREFIX`, else
`<checkout>/.harnesses`, where ops/install.sh puts them), world-readable so the sandbox
uid runs them; node comes from /usr/bin. `installed(name)` says whether a profile's
program is there.

Execution keys (DESIGN.md "Processes": per-execution key): `execution_key(secret, e)` =
`gyre-<e>-<first 32 hex digits of HMAC-SHA256(secret, e)>`; the proxy recovers and
checks the execution with `verify_key` (constant-time comparison).
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import os
import sys
from pathlib import Path
from typing import Callable, Mapping

from gyre.env.tasks import DATA_DIR, Task

HARNESS_DIR = DATA_DIR / "harness"
KEY_PREFIX = "gyre-"
_MAC_HEX = 32
CLAUDE_CODE_VERSION = "2.1.197"
CODEX_VERSION = "0.171.0"
CLAUDE_CODE_TOOLS = "Bash Write Read Edit Agent"
"""Tools Claude Code may use without asking (`--allowedTools`)."""
CODEX_KEY_ENV = "GYRE_CODEX_API_KEY"
"""Environment variable Codex reads the execution key from (the provider's `env_key`)."""


def harness_prefix() -> Path:
    """npm prefix of the Claude Code / Codex installation: `$GYRE_HARNESS_PREFIX`, else
    `<checkout>/.harnesses` (ops/install.sh)."""
    env = os.environ.get("GYRE_HARNESS_PREFIX")
    return Path(env).resolve() if env else Path(__file__).resolve().parents[2] / ".harnesses"


NPM_PROGRAMS = {"claude-code": "claude", "codex": "codex"}


def installed(profile: str) -> bool:
    """True when the program behind `profile` can be started (npm harnesses: its binary is
    under harness_prefix(); mini-swe-agent: `mini` beside this interpreter; toy: always)."""
    program = NPM_PROGRAMS.get(profile)
    if profile.startswith("mini-swe-agent"):
        return os.access(Path(sys.executable).parent / "mini", os.X_OK)
    if program is None:
        return profile in PROFILES
    return os.access(harness_prefix() / "bin" / program, os.X_OK)


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
    try:
        expected = hmac.new(secret, execution.encode("utf-8"), hashlib.sha256).hexdigest()[:_MAC_HEX]
        return execution if hmac.compare_digest(expected, mac) else None
    except (UnicodeEncodeError, TypeError):  # a header's non-UTF-8 bytes (surrogates), a non-ASCII MAC
        return None


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
    context_tokens: the policy's context window in tokens (0 = not known); profiles pass it
      on where the harness takes one, so that it compacts before the proxy must refuse.
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
    context_tokens: int = 0


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


def synthetic(req: LaunchRequest) -> HarnessCommand:
    """The synthetic harness: calls with think times, its duration drawn from the workload in
    the workspace's `workload.json` and its execution id (gyre/env/data/harness/synthetic_harness.py)."""
    argv = [req.python, str(req.home / "synthetic_harness.py"), "--model", req.model]
    env = {"OPENAI_BASE_URL": f"{req.proxy_url.rstrip('/')}/v1", "OPENAI_API_KEY": req.api_key}
    files = {"synthetic_harness.py": (HARNESS_DIR / "synthetic_harness.py").read_text()}
    return HarnessCommand(argv=argv, env=env, files=files, readonly=python_installation(req.python))


def _npm_readonly(prefix: Path) -> tuple[str, ...]:
    """The npm prefix plus the real directories its bin links point into, when outside it."""
    paths = [str(prefix)]
    real = Path(os.path.realpath(prefix))
    if str(real) != str(prefix):
        paths.append(str(real))
    return tuple(paths)


def _own_tmp(req: LaunchRequest) -> tuple[dict[str, str], dict[str, str]]:
    """(env, files) giving the harness a temporary directory of its own, <home>/tmp: the
    sandbox's private /tmp is not writable by the sandbox uid, and Claude Code exits 0
    silently, before its first call, when it cannot write its temporary files."""
    return {"TMPDIR": str(req.home / "tmp")}, {"tmp/.keep": ""}


def claude_code(req: LaunchRequest) -> HarnessCommand:
    """Claude Code, headless (HARNESSES.md "Claude Code"): `claude -p TASK --output-format
    json --permission-mode acceptEdits --allowedTools "Bash Write Read Edit Agent" --model
    <model>`, Anthropic Messages at the proxy's base URL, non-essential traffic, telemetry,
    auto-update and error reporting off, HOME = the execution's home. `max_calls` becomes
    `--max-turns`."""
    prefix = harness_prefix()
    argv = [str(prefix / "bin" / "claude"), "-p", req.task.problem_statement, "--output-format", "json",
            "--permission-mode", "acceptEdits", "--allowedTools", CLAUDE_CODE_TOOLS, "--model", req.model]
    if req.max_calls > 0:
        argv += ["--max-turns", str(req.max_calls)]
    env = {
        "ANTHROPIC_BASE_URL": req.proxy_url.rstrip("/"),
        "ANTHROPIC_API_KEY": req.api_key,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_BUG_COMMAND": "1",
        "SHELL": "/bin/bash",
        "NO_COLOR": "1",
    }
    tmp_env, files = _own_tmp(req)
    env.update(tmp_env)
    return HarnessCommand(argv=argv, env=env, files=files, readonly=_npm_readonly(prefix),
                          path_dirs=(str(prefix / "bin"),))


def codex_config(proxy_url: str, model: str, context_tokens: int = 0) -> str:
    """`$CODEX_HOME/config.toml` for one execution: a custom provider at `<proxy>/v1`
    speaking Responses, the key from CODEX_KEY_ENV, no approvals, no sandbox of its own (gyre
    confines it), no update check, analytics off; `model_context_window` = context_tokens
    when known. Codex knows no window for a model name it does not ship, and then never
    compacts: a rollout that outgrows the context ends in `turn.failed` on the proxy's
    `context_length_exceeded` (Codex CLI 0.171, measured), where with the window set it
    compacts first and goes on."""
    template = (HARNESS_DIR / "codex_config.toml").read_text()
    window = f"model_context_window = {int(context_tokens)}" if context_tokens > 0 else ""
    return template.replace("@BASE_URL@", json.dumps(f"{proxy_url.rstrip('/')}/v1")).replace(
        "@MODEL@", json.dumps(model)).replace("@ENV_KEY@", json.dumps(CODEX_KEY_ENV)).replace(
        "@CONTEXT_WINDOW@", window)


def codex(req: LaunchRequest) -> HarnessCommand:
    """Codex CLI (HARNESSES.md "Codex CLI"): `codex exec --skip-git-repo-check --json TASK`
    with CODEX_HOME = <home>/.codex holding `codex_config`."""
    prefix = harness_prefix()
    argv = [str(prefix / "bin" / "codex"), "exec", "--skip-git-repo-check", "--json", req.task.problem_statement]
    env = {"CODEX_HOME": str(req.home / ".codex"), CODEX_KEY_ENV: req.api_key, "SHELL": "/bin/bash",
           "NO_COLOR": "1"}
    tmp_env, files = _own_tmp(req)
    env.update(tmp_env)
    files[".codex/config.toml"] = codex_config(req.proxy_url, req.model, req.context_tokens)
    return HarnessCommand(argv=argv, env=env, files=files, readonly=_npm_readonly(prefix),
                          path_dirs=(str(prefix / "bin"),))


PROFILES: Mapping[str, Profile] = {
    "mini-swe-agent": mini_swe_agent,
    "mini-swe-agent-text": mini_swe_agent_text,
    "toy": toy,
    "synthetic": synthetic,
    "claude-code": claude_code,
    "codex": codex,
}
DEFAULT_PROFILE = "mini-swe-agent"


def get_profile(name: str) -> Profile:
    """The profile called `name`. Raises KeyError naming the known profiles."""
    try:
        return PROFILES[name]
    except KeyError:
        raise KeyError(f"unknown harness profile {name!r}; known: {sorted(PROFILES)}") from None
