#!/usr/bin/env bash
# Installs gyre and what its tests and demo need into ./.venv (the README's steps).
#  - The venv is made from an interpreter that an unprivileged uid can read, because
#    harnesses run confined under such a uid (DESIGN.md "Processes", runner); a Python
#    under /root (pyenv) is unreadable to them.
#  - torch 2.13.0 goes in first so nothing pulls a CUDA build: the CPU build, a local
#    `2.13.0+cpu` wheel where pip finds one (the project's VM), else from PyTorch's CPU
#    index (PyPI's Linux wheel is the CUDA build). A torch 2.13.0 already in the venv (a
#    CUDA build put there for the `gpu` tests) is kept.
#  - bubblewrap confines harness processes; installed from Debian when we are root, as
#    are chromium and chromium-driver (the test extra's browser test renders `gyre report`
#    in headless Chromium through selenium; without them it skips, or fails under CI=true).
#  - Mooncake's transfer engine: the CPU build (PyPI mooncake-transfer-engine-non-cuda, a
#    dependency) and Debian's libibverbs1, which it links even for TCP; the CUDA build is
#    the `mooncake` extra for clusters (it needs libcudart).
#  - Claude Code and Codex CLI (npm) go into ./.harnesses (world-readable, so the
#    sandbox uid can run them), pinned to the versions docs/tasks.md names; skipped when
#    already there at that version, or when npm is missing (their tests then skip,
#    or fail under CI=true).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}

pick_python() {
  for cand in ${GYRE_PYTHON:-} /usr/bin/python3.11 /usr/bin/python3 /usr/local/bin/python3.11 "$(command -v python3 || true)"; do
    [ -n "$cand" ] && [ -x "$cand" ] || continue
    "$cand" -c 'import sys, venv, ensurepip; assert sys.version_info >= (3, 11)' 2>/dev/null || continue
    echo "$cand"; return 0
  done
  echo "no Python >= 3.11 with venv found (set GYRE_PYTHON)" >&2; return 1
}

# apt_tool COMMAND PACKAGE WHY IF_MISSING: Debian's PACKAGE when COMMAND is absent and we are root
apt_tool() {
  if ! command -v "$1" >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "install: $2 ($3)"
    (apt-get install -y -q "$2" >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q "$2" >/dev/null 2>&1; }) \
      || echo "install: $2 unavailable; $4" >&2
  fi
}
apt_tool bwrap bubblewrap "harness confinement" "harnesses run under an unprivileged uid without it"
apt_tool tmux tmux "drives Claude Code's interactive TUI and gyre status in the tests" "the interactive Claude Code and live gyre status tests cannot run"
apt_tool chromium chromium "renders gyre report in the browser test" "the browser test skips"
apt_tool chromedriver chromium-driver "drives headless Chromium in the browser test" "the browser test skips"
# Mooncake's transfer engine (the CPU build, mooncake-transfer-engine-non-cuda, from pyproject)
# links libibverbs even for TCP: Debian's libibverbs1 provides it.
if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1' && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "install: libibverbs1 (Mooncake's transfer engine links it)"
  (apt-get install -y -q libibverbs1 >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libibverbs1 >/dev/null 2>&1; }) \
    || echo "install: libibverbs1 unavailable; the Mooncake tests skip (fail under CI=true) and cells use loopback" >&2
fi

if [ ! -x "$VENV/bin/python" ]; then
  PY=$(pick_python)
  echo "install: creating $VENV from $PY"
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
if ! "$VENV/bin/python" -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
  "$VENV/bin/python" -m pip install -q "torch==2.13.0+cpu" 2>/dev/null \
    || "$VENV/bin/python" -m pip install -q "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
fi
"$VENV/bin/python" -m pip install -q -e ".[test,harness]"
chmod -R a+rX "$VENV" 2>/dev/null || true

HARNESS_PREFIX=${GYRE_HARNESS_PREFIX:-.harnesses}
CLAUDE_CODE_VERSION=2.1.197
CODEX_VERSION=0.171.0
npm_harness() {  # package version binary
  local pkg=$1 version=$2 bin=$3 have=""
  if [ -x "$HARNESS_PREFIX/bin/$bin" ]; then
    have=$(node -p "require('./$HARNESS_PREFIX/lib/node_modules/$pkg/package.json').version" 2>/dev/null || true)
  fi
  if [ "$have" = "$version" ]; then
    echo "install: $pkg $version already in $HARNESS_PREFIX"
  else
    echo "install: $pkg@$version into $HARNESS_PREFIX"
    npm install -g --prefix "$HARNESS_PREFIX" --no-audit --no-fund --loglevel=error "$pkg@$version" >/dev/null
    # Claude Code's postinstall copies its native binary over a stub; newer npm may skip it.
    if [ -f "$HARNESS_PREFIX/lib/node_modules/$pkg/install.cjs" ] && ! "$HARNESS_PREFIX/bin/$bin" --version >/dev/null 2>&1; then
      (cd "$HARNESS_PREFIX/lib/node_modules/$pkg" && node install.cjs >/dev/null)
    fi
  fi
  "$HARNESS_PREFIX/bin/$bin" --version >/dev/null 2>&1 || { echo "install: $HARNESS_PREFIX/bin/$bin does not run" >&2; return 1; }
}
if command -v npm >/dev/null 2>&1 && command -v node >/dev/null 2>&1; then
  mkdir -p "$HARNESS_PREFIX"
  npm_harness @anthropic-ai/claude-code "$CLAUDE_CODE_VERSION" claude
  npm_harness @openai/codex "$CODEX_VERSION" codex
  chmod -R a+rX "$HARNESS_PREFIX" 2>/dev/null || true
  echo "install: harnesses: $("$HARNESS_PREFIX/bin/claude" --version), $("$HARNESS_PREFIX/bin/codex" --version)"
else
  echo "install: npm/node not found; Claude Code and Codex CLI not installed (their tests skip)" >&2
fi
echo "install: done ($("$VENV/bin/python" -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__)'))"
