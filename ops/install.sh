#!/usr/bin/env bash
# Installs gyre and what its tests and demo need into ./.venv (the README's steps).
#  - The venv is made from an interpreter that an unprivileged uid can read, because
#    harnesses run confined under such a uid (DESIGN.md "Processes", runner); a Python
#    under /root (pyenv) is unreadable to them.
#  - torch 2.13.0 (CPU build) goes in first so nothing pulls a CUDA build.
#  - bubblewrap confines harness processes; installed from Debian when we are root.
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

if ! command -v bwrap >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "install: bubblewrap (harness confinement)"
  (apt-get install -y -q bubblewrap >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q bubblewrap >/dev/null 2>&1; }) \
    || echo "install: bubblewrap unavailable; harnesses run under an unprivileged uid without it" >&2
fi

if [ ! -x "$VENV/bin/python" ]; then
  PY=$(pick_python)
  echo "install: creating $VENV from $PY"
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "torch==2.13.0"
"$VENV/bin/python" -m pip install -q -e ".[test,harness]"
chmod -R a+rX "$VENV" 2>/dev/null || true
echo "install: done ($("$VENV/bin/python" -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__)'))"
