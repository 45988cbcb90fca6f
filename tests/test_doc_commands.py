"""The commands and links of README.md and docs/ work.

Every fenced block on these pages names its language, and every shell block (`bash`,
`sh`, `shell`, `console`) is marked by an HTML comment on the line just above it:

- `<!-- run -->`: it finishes within a minute on 2 cores, so it is run here, with bash
  (`set -eo pipefail`), in a temporary directory, with the project's venv first on PATH
  (the directory of `sys.executable`, as `make test` runs it) and this checkout first on
  PYTHONPATH. What it leaves running is stopped with its process group afterwards.
- `<!-- parse -->`: long benchmarks, cluster commands, live followers. Each command's
  program, module, script or make target must exist, and every flag it passes must
  appear in that command's `--help` (gyre, `python -m`, a script, nats-server). Other
  programs (curl, jq, the shell's own) are not ours and are not checked.

Relative links, and their `#anchors`, resolve. The four contract copies
(docs/DESIGN.md, BENCHMARKS.md, HARNESSES.md, STYLE.md) are skipped: they stay
byte-equal to the project's contract, so their blocks are not ours to mark (links into
them are still checked).
"""
from __future__ import annotations

import dataclasses
import functools
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
CONTRACT = {"DESIGN.md", "BENCHMARKS.md", "HARNESSES.md", "STYLE.md"}
PAGES = [ROOT / "README.md"] + sorted(p for p in (ROOT / "docs").glob("*.md") if p.name not in CONTRACT)
SHELL = {"bash", "sh", "shell", "console"}
RUN_TIMEOUT_S = 150.0
"""One `run` block's limit; the longest (`gyre run toy`) takes 40–60 s on 2 cores."""
STOP_GRACE_S = 5.0
"""How long what a block left running gets after SIGTERM before SIGKILL."""


@dataclasses.dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    mark: str  # "run", "parse" or ""
    text: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of `page`, each with its language and its mark."""
    lines = page.read_text("utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"^( *)(`{3,}|~{3,})(.*)$", lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = len(m[1]), m[2], m[3].strip()
        end = i + 1
        while end < len(lines) and not re.match(rf"^ *{fence[0]}{{{len(fence)},}}\s*$", lines[end]):
            end += 1
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        mark = re.fullmatch(r"\s*<!-- (run|parse) -->\s*", before)
        text = "\n".join(line[indent:] for line in lines[i + 1:end])
        out.append(Block(page, i + 1, info.split()[0] if info else "", mark[1] if mark else "", text))
        i = end + 1
    return out


ALL_BLOCKS = [b for page in PAGES for b in blocks(page)]
RUN_BLOCKS = [b for b in ALL_BLOCKS if b.lang in SHELL and b.mark == "run"]
PARSE_BLOCKS = [b for b in ALL_BLOCKS if b.lang in SHELL and b.mark == "parse"]


def test_every_block_names_its_language_and_every_shell_block_its_check():
    assert RUN_BLOCKS and PARSE_BLOCKS
    unnamed = [b.where for b in ALL_BLOCKS if not b.lang]
    unmarked = [b.where for b in ALL_BLOCKS if b.lang in SHELL and not b.mark]
    assert {"no language": unnamed, "shell block without <!-- run --> or <!-- parse -->": unmarked} == {
        "no language": [], "shell block without <!-- run --> or <!-- parse -->": []}


# --- run blocks -------------------------------------------------------------------------

def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("GYRE_NATS_URL", "GYRE_NATS_TOKEN", "GYRE_KEY_SECRET", "GYRE_RUNS_DIR", "VIRTUAL_ENV")}
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def _port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _stop_group(pgid: int) -> None:
    """SIGTERM, then SIGKILL, the process group a block ran in (its background servers)."""
    for sig, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, STOP_GRACE_S)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        end = time.monotonic() + wait_s
        while time.monotonic() < end:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


@pytest.mark.parametrize("block", RUN_BLOCKS, ids=lambda b: b.where)
def test_a_run_block_runs(block: Block, tmp_path: Path):
    ports = {int(p) for p in re.findall(r"(?:--port|-p) (\d+)\b", block.text)}
    busy = sorted(p for p in ports if _port_in_use(p))
    if busy:
        pytest.skip(f"{block.where} listens on port(s) {busy}, in use on this machine")
    log = tmp_path / "block.log"
    with log.open("w") as out:
        proc = subprocess.Popen(["bash", "-c", "set -eo pipefail\n" + block.text], cwd=tmp_path, env=_env(),
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            _stop_group(proc.pid)
            proc.wait()
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
    assert rc == 0, f"{block.where} {'timed out' if rc is None else f'exited {rc}'}:\n{tail}"


# --- parse blocks -----------------------------------------------------------------------

def _substitutions(line: str) -> tuple[str, list[str]]:
    """`line` with each `$(...)` replaced by a placeholder word, and the commands inside them."""
    out, inner, i, quote = [], [], 0, ""
    while i < len(line):
        c = line[i]
        if quote != "'" and line.startswith("$(", i):
            depth, j, q = 1, i + 2, ""
            while j < len(line) and depth:
                d = line[j]
                if q:
                    q = "" if d == q else q
                elif d in "'\"":
                    q = d
                elif d == "(":
                    depth += 1
                elif d == ")":
                    depth -= 1
                j += 1
            inner.append(line[i + 2:j - 1])
            out.append("SUBST")
            i = j
            continue
        if c in "'\"" and (not quote or quote == c):
            quote = "" if quote else c
        out.append(c)
        i += 1
    return "".join(out), inner


KEYWORDS = {"if", "then", "else", "elif", "fi", "for", "while", "until", "do", "done", "!", "time"}


def simple_commands(text: str) -> list[list[str]]:
    """The simple commands of a shell block, as words: continuation lines joined, comments,
    redirections, leading assignments and shell keywords dropped, `$(...)` bodies included."""
    commands = []
    pending = [line for line in text.replace("\\\n", " ").splitlines()]
    while pending:
        line, inner = _substitutions(pending.pop(0))
        pending += inner
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|<>")
        lexer.whitespace_split = True
        words: list[str] = []
        tokens = list(lexer)
        k = 0
        while k <= len(tokens):
            tok = tokens[k] if k < len(tokens) else ";"
            if tok and set(tok) <= set(";&|"):
                while words and (words[0] in KEYWORDS or re.match(r"^[A-Za-z_]\w*=", words[0])):
                    words.pop(0)
                if words and words[0] != "export":
                    commands.append(words)
                words = []
            elif tok and set(tok) <= set("<>&"):
                if words and words[-1].isdigit():
                    words.pop()  # the descriptor of `2>&1`
                k += 1  # a redirection: its target is no argument
            else:
                words.append(tok)
            k += 1
    return commands


@functools.cache
def _help(*argv: str) -> str:
    proc = subprocess.run([*argv, "--help"], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=60,
                          check=False)
    assert proc.returncode == 0, f"{' '.join(argv)} --help exited {proc.returncode}: {proc.stderr[-2000:]}"
    return proc.stdout + proc.stderr


def _flags_missing(flags: list[str], help_text: str) -> list[str]:
    names = {f.split("=", 1)[0] for f in flags if f.startswith("-") and f not in ("-", "--")}
    return sorted(n for n in names if not re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", help_text))


def check_command(words: list[str]) -> list[str]:
    """What is wrong with one command of a parse block (empty: nothing)."""
    prog, args = re.sub(r"^(\./)?\.venv/bin/", "", words[0]), words[1:]
    problems = []
    if prog == "gyre":
        sub = args[:2] if args[:1] == ["bench"] else args[:1]
        problems = _flags_missing(args[len(sub):], _help(str(VENV_BIN / "gyre"), *sub))
    elif prog in ("python", "python3"):
        if args[:1] == ["-c"]:
            compile(args[1], "<python -c>", "exec")
        elif args[:1] == ["-m"]:
            problems = _flags_missing(args[2:], _help(sys.executable, "-m", args[1]))
        elif args and args[0].endswith(".py"):
            if not (ROOT / args[0]).is_file():
                return [f"no script {args[0]}"]
            problems = _flags_missing(args[1:], _help(sys.executable, str(ROOT / args[0])))
    elif prog == "nats-server":
        problems = _flags_missing(args, _help(str(VENV_BIN / "nats-server")))
    elif prog == "make":
        targets = set(re.findall(r"^([\w.-]+):", (ROOT / "Makefile").read_text(), re.M))
        problems = [f"no make target {t}" for t in args if not t.startswith("-") and "=" not in t
                    and t not in targets]
    return [f"{' '.join(words[:3])}: {p}" for p in problems]


@pytest.mark.parametrize("block", PARSE_BLOCKS, ids=lambda b: b.where)
def test_a_parse_block_names_commands_and_flags_that_exist(block: Block):
    commands = simple_commands(block.text)
    assert commands, f"{block.where}: no command found"
    problems = [p for words in commands for p in check_command(words)]
    assert problems == [], block.where


def test_the_parser_sees_what_bash_runs():
    text = ('A=1 gyre run toy --set x.y=2 > out.log 2>&1 &  # a comment\n'
            'KEY=$(python -c "import os; print(1)")\n'
            'until [ -s f ]; do sleep 1; done; make test \\\n  PYTEST_ARGS="a b"\n'
            'export X=1 Y=$(python -m handlers.cli --z)\n')
    assert simple_commands(text) == [
        ["gyre", "run", "toy", "--set", "x.y=2"], ["[", "-s", "f", "]"], ["sleep", "1"],
        ["make", "test", 'PYTEST_ARGS=a b'], ["python", "-c", "import os; print(1)"],
        ["python", "-m", "handlers.cli", "--z"]]
    assert check_command(["gyre", "run", "--no-such-flag"]) == ["gyre run --no-such-flag: --no-such-flag"]


# --- links ------------------------------------------------------------------------------

def _without_code(text: str) -> str:
    """The page without fenced blocks and inline code, where a `[x](y)` is no link."""
    text = re.sub(r"^( *)(`{3,}|~{3,}).*?^\1\2\s*$", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces → '-'."""
    text = re.sub(r"^( *)(`{3,}|~{3,}).*?^\1\2\s*$", "", page.read_text("utf-8"), flags=re.M | re.S)
    out: set[str] = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n, unique = 0, slug
        while unique in out:
            n += 1
            unique = f"{slug}-{n}"
        out.add(unique)
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", _without_code(page.read_text("utf-8"))):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in anchors(dest)):
            broken.append(target)
    assert broken == []
