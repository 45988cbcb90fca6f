"""Tasks: the JSONL task format, loading with validation, workspace seeding, grading.

Format (one JSON object per line; blank lines and lines starting with `#` are skipped;
close to SWE-bench / NL2Repo records, see docs/tasks.md):

    instance_id        str, required. Unique in the file; letters, digits, `_ . -`.
    problem_statement  str, required. The spec given to the agent (the harness's task).
    files              {path: content}, starting files seeded into the workspace.
    test_files         {path: content}, required, ≥ 1, unless `expected` is given. Hidden
                       pytest files; never shown to the agent, written into a copy of the
                       workspace at grading.
    expected           {path: content}, optional. An exact answer: each file must hold
                       this text (surrounding whitespace ignored); graded in the evaluator's
                       process without running anything (`grade_expected`), reward = the
                       fraction of files that match. With `test_files` as well, the
                       hidden tests decide and `expected` is not used.
    test_command       str, default `python -m pytest -q -p no:cacheprovider`; the
                       evaluator appends its own options and the hidden test paths.
    timeout_s          float > 0, default 600. Suggested wall-clock limit of one execution.
    test_timeout_s     float > 0, default 120. Limit for running the hidden tests.
    difficulty         `easy` | `medium` | `hard`, default `easy`.
    tags               [str], default [].
    solution           {path: content}, optional reference solution (like SWE-bench's
                       `patch`): never shown to the agent; used to self-check the task.

Paths are relative POSIX paths without `..`; test paths end in `.py` and may not
collide with starting files. Unknown fields are ignored (forward compatibility).

Grading contract (pure parts; the evaluator daemon runs the process): the hidden tests
run with `pytest_args` added to `test_command`; the junit XML report (xunit1, with
`file` attributes) gives passed/total over the hidden test files only. A run whose
guard plugin never reported `configured` is an infrastructure failure (`GradeError`);
anything after pytest started is the agent's responsibility (a hidden test file that
fails to import the agent's code counts all its tests as failed; a run killed at its
timeout keeps the tests that passed so far: partial credit).
"""
from __future__ import annotations

import ast
import dataclasses
import json
import re
import os
import shlex
import shutil
import stat
import xml.etree.ElementTree as ET
from pathlib import Path, PurePosixPath
from typing import Any, Iterable, Mapping

DEFAULT_TEST_COMMAND = "python -m pytest -q -p no:cacheprovider"
DIFFICULTIES = ("easy", "medium", "hard")
DATA_DIR = Path(__file__).parent / "data"
TASKS_DIR = DATA_DIR / "tasks"
GUARD_PLUGIN = DATA_DIR / "eval" / "gyre_pytest_guard.py"
_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


class TaskError(ValueError):
    """A task file or record is invalid. `source`, `line` (1-based or None), `field`."""

    def __init__(self, message: str, *, source: str = "", line: int | None = None, field: str | None = None):
        where = source + (f":{line}" if line is not None else "")
        prefix = f"{where}: " if where else ""
        super().__init__(f"{prefix}{field + ': ' if field else ''}{message}")
        self.source, self.line, self.field = source, line, field


class GradeError(RuntimeError):
    """Grading failed for a reason outside the agent's control (infrastructure)."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Task:
    """One task record (see the module docstring for each field's meaning)."""

    instance_id: str
    problem_statement: str
    files: Mapping[str, str]
    test_files: Mapping[str, str]
    test_command: str = DEFAULT_TEST_COMMAND
    timeout_s: float = 600.0
    test_timeout_s: float = 120.0
    difficulty: str = "easy"
    tags: tuple[str, ...] = ()
    solution: Mapping[str, str] = dataclasses.field(default_factory=dict)
    expected: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @property
    def expected_tests(self) -> int:
        """Number of hidden test cases counted statically (see `count_tests`)."""
        return sum(count_tests(src) for src in self.test_files.values())


# ---------------------------------------------------------------- loading


def bundled_task_sets() -> list[str]:
    """Names of the task sets shipped in gyre/env/data/tasks (e.g. `quickstart`, `toy`)."""
    return sorted(p.stem for p in TASKS_DIR.glob("*.jsonl"))


def resolve_task_set(name_or_path: str | Path) -> Path:
    """A bundled name (`quickstart`) → its JSONL path; any existing path → itself.

    Raises TaskError naming the known bundled sets when neither exists.
    """
    path = Path(name_or_path)
    if path.suffix == ".jsonl" or path.exists():
        if not path.is_file():
            raise TaskError("task file does not exist", source=str(path))
        return path
    bundled = TASKS_DIR / f"{name_or_path}.jsonl"
    if bundled.is_file():
        return bundled
    raise TaskError(f"no task file or bundled task set named {str(name_or_path)!r} "
                    f"(bundled: {', '.join(bundled_task_sets())})")


def load_tasks(name_or_path: str | Path) -> list[Task]:
    """Load and validate a task set (bundled name or JSONL path).

    Returns the tasks in file order. Raises TaskError naming the file, line and field.
    """
    path = resolve_task_set(name_or_path)
    tasks: list[Task] = []
    seen: dict[str, int] = {}
    for lineno, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not raw.strip() or raw.lstrip().startswith("#"):
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise TaskError(f"not valid JSON ({exc.msg} at column {exc.colno})", source=str(path), line=lineno) from None
        task = parse_task(obj, source=str(path), line=lineno)
        if task.instance_id in seen:
            raise TaskError(f"duplicate instance_id {task.instance_id!r} (first on line {seen[task.instance_id]})",
                            source=str(path), line=lineno, field="instance_id")
        seen[task.instance_id] = lineno
        tasks.append(task)
    if not tasks:
        raise TaskError("contains no tasks", source=str(path))
    return tasks


def task_index(tasks: Iterable[Task]) -> dict[str, Task]:
    """Tasks by instance_id."""
    return {t.instance_id: t for t in tasks}


def parse_task(obj: Any, *, source: str = "", line: int | None = None) -> Task:
    """Validate one decoded record and build a Task. Raises TaskError."""

    def err(field: str | None, message: str) -> TaskError:
        return TaskError(message, source=source, line=line, field=field)

    if not isinstance(obj, dict):
        raise err(None, f"a task record must be a JSON object, got {type(obj).__name__}")
    for name in ("instance_id", "problem_statement"):
        if name not in obj:
            raise err(name, "missing required field")
    if "test_files" not in obj and not obj.get("expected"):
        raise err("test_files", "missing required field (or give `expected`)")
    iid = obj["instance_id"]
    if not isinstance(iid, str) or not _ID_RE.match(iid):
        raise err("instance_id", f"must be 1-128 characters of letters, digits, '_', '.', '-' (got {iid!r})")
    ps = obj["problem_statement"]
    if not isinstance(ps, str) or not ps.strip():
        raise err("problem_statement", "must be a non-empty string")
    files = _file_map(obj.get("files", {}), "files", err)
    tests = _file_map(obj.get("test_files", {}), "test_files", err)
    solution = _file_map(obj.get("solution", {}), "solution", err)
    expected = _file_map(obj.get("expected", {}), "expected", err)
    if not tests and not expected:
        raise err("test_files", "needs at least one hidden test file (or `expected`)")
    for path, src in tests.items():
        if not path.endswith(".py"):
            raise err("test_files", f"{path!r} is not a .py file")
        if path in files:
            raise err("test_files", f"{path!r} collides with a starting file")
        _check_python(src, f"test_files[{path!r}]", err)
        if count_tests(src) < 1:
            raise err("test_files", f"{path!r} defines no test functions")
    for path, src in solution.items():
        if path.endswith(".py"):
            _check_python(src, f"solution[{path!r}]", err)
    command = obj.get("test_command", DEFAULT_TEST_COMMAND)
    if not isinstance(command, str) or not command.strip():
        raise err("test_command", "must be a non-empty string")
    try:
        shlex.split(command)
    except ValueError as exc:
        raise err("test_command", f"cannot be split like a shell line ({exc})") from None
    timeout_s = _positive(obj.get("timeout_s", 600.0), "timeout_s", err)
    test_timeout_s = _positive(obj.get("test_timeout_s", 120.0), "test_timeout_s", err)
    difficulty = obj.get("difficulty", "easy")
    if difficulty not in DIFFICULTIES:
        raise err("difficulty", f"must be one of {list(DIFFICULTIES)} (got {difficulty!r})")
    tags = obj.get("tags", [])
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise err("tags", "must be a list of strings")
    return Task(instance_id=iid, problem_statement=ps, files=files, test_files=tests, test_command=command,
                timeout_s=timeout_s, test_timeout_s=test_timeout_s, difficulty=difficulty, tags=tuple(tags),
                solution=solution, expected=expected)


def _file_map(value: Any, field: str, err) -> dict[str, str]:
    if not isinstance(value, dict):
        raise err(field, f"must be an object mapping path to content, got {type(value).__name__}")
    for path, content in value.items():
        problem = check_relative_path(path)
        if problem:
            raise err(field, f"bad path {path!r}: {problem}")
        if not isinstance(content, str):
            raise err(field, f"content of {path!r} must be a string")
    return dict(value)


def check_relative_path(path: str) -> str | None:
    """Why `path` is not an acceptable relative file path, or None when it is."""
    if not path or "\\" in path or "\x00" in path:
        return "must be a non-empty POSIX path"
    p = PurePosixPath(path)
    if p.is_absolute():
        return "must be relative"
    if any(part in ("", ".", "..") for part in path.split("/")):
        return "must not contain '.', '..' or empty components"
    return None


def _positive(value: Any, field: str, err) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise err(field, f"must be a number > 0 (got {value!r})")
    return float(value)


def _check_python(src: str, label: str, err) -> None:
    try:
        compile(src, label, "exec", dont_inherit=True)
    except SyntaxError as exc:
        raise err(label.split("[")[0], f"{label} line {exc.lineno}: SyntaxError: {exc.msg}") from None


def count_tests(source: str) -> int:
    """Statically count pytest test cases in a module's source.

    Counts top-level `test*` functions and `test*` methods of top-level `Test*` classes;
    a `@pytest.mark.parametrize(names, [..literal..])` multiplies by its literal length.
    Returns 0 for source that does not parse.
    """
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return 0

    def weight(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
        n = 1
        for dec in fn.decorator_list:
            if isinstance(dec, ast.Call) and getattr(dec.func, "attr", "") == "parametrize" and len(dec.args) >= 2:
                if isinstance(dec.args[1], (ast.List, ast.Tuple)):
                    n *= len(dec.args[1].elts)
        return n

    total = 0
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            total += weight(node)
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            total += sum(weight(m) for m in node.body
                         if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and m.name.startswith("test"))
    return total


# ---------------------------------------------------------------- workspaces


def write_files(root: Path, files: Mapping[str, str]) -> list[Path]:
    """Write `files` (relative path → text) under `root`, creating directories.

    Any symlink, file or directory in the way (left by an agent in a copy being graded)
    is removed first, so a write never follows a link out of `root`. Returns the written
    paths. Raises TaskError on a path that is not a clean relative path.
    """
    root = Path(root)
    written = []
    for rel, content in files.items():
        problem = check_relative_path(rel)
        if problem:
            raise TaskError(f"bad path {rel!r}: {problem}")
        parts = rel.split("/")
        here = root
        for part in parts[:-1]:
            here = here / part
            if here.is_symlink() or (here.exists() and not here.is_dir()):
                here.unlink()
            here.mkdir(exist_ok=True)
        dest = here / parts[-1]
        if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
            dest.unlink()
        elif dest.is_dir():
            shutil.rmtree(dest)
        dest.write_text(content, encoding="utf-8")
        written.append(dest)
    return written


def copy_workspace(src: Path, dst: Path) -> None:
    """Copy a preserved workspace for grading: regular files and directories are copied,
    symlinks are copied as links (never followed), anything else (FIFOs, sockets,
    devices) is skipped. `dst` must not exist. Raises OSError."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True)
    for dirpath, dirnames, filenames in os.walk(src, followlinks=False):
        rel = Path(dirpath).relative_to(src)
        for name in list(dirnames):
            s = Path(dirpath) / name
            if s.is_symlink():
                os.symlink(os.readlink(s), dst / rel / name)
                dirnames.remove(name)
            else:
                (dst / rel / name).mkdir()
        for name in filenames:
            s = Path(dirpath) / name
            if s.is_symlink():
                os.symlink(os.readlink(s), dst / rel / name)
            elif s.is_file():
                shutil.copyfile(s, dst / rel / name, follow_symlinks=False)
                shutil.copymode(s, dst / rel / name)


def seed_workspace(task: Task, workspace: Path) -> list[Path]:
    """Create `workspace` (must not exist or be empty) holding the task's starting files.

    Hidden tests and the solution are never written here. Raises FileExistsError when
    the directory exists and is not empty; OSError on I/O failure.
    """
    workspace = Path(workspace)
    if workspace.exists() and any(workspace.iterdir()):
        raise FileExistsError(f"workspace {workspace} already exists and is not empty")
    workspace.mkdir(parents=True, exist_ok=True)
    return write_files(workspace, task.files)


# ---------------------------------------------------------------- grading

# Written by the evaluator into the graded copy (overriding any agent file of that name);
# `pythonpath = .` makes the agent's modules importable after pytest itself is imported.
PYTEST_INI_NAME = ".gyre-pytest.ini"
PYTEST_INI = "[pytest]\njunit_family = xunit1\naddopts =\npythonpath = .\nasyncio_default_fixture_loop_scope = function\n"


@dataclasses.dataclass(frozen=True, slots=True)
class Grade:
    """Result of grading one workspace.

    reward: passed / total in [0, 1]. passed, total: hidden test cases.
    note: how the numbers were obtained (`junit`, `partial: ...`, `collection error in ...`).
    """

    reward: float
    passed: int
    total: int
    note: str = "junit"


EXPECTED_MAX_BYTES = 65536
"""Largest answer file `grade_expected` reads; a longer one does not match."""


def grade_expected(task: Task, workspace: Path) -> Grade:
    """Reward of a task with an exact answer (`Task.expected`): the fraction of its files
    whose text, stripped of surrounding whitespace, equals the expected text stripped.

    A file that is missing, not a regular file, reached through a symbolic link (never
    followed: the agent may have linked anything), undecodable as UTF-8 or longer than
    EXPECTED_MAX_BYTES does not match. Runs nothing; raises GradeError when the task has
    no `expected` files."""
    if not task.expected:
        raise GradeError(f"task {task.instance_id} has no expected answer")
    root = Path(workspace)
    matched = 0
    for rel, want in task.expected.items():
        got = _read_plain(root, rel)
        matched += got is not None and got.strip() == want.strip()
    total = len(task.expected)
    return Grade(reward=matched / total, passed=matched, total=total, note="expected")


def _read_plain(root: Path, rel: str) -> str | None:
    """The UTF-8 text of `root/rel` when every component is a plain directory or file
    (no link), at most EXPECTED_MAX_BYTES long; else None."""
    here = root
    for part in rel.split("/"):
        here = here / part
        if here.is_symlink():
            return None
    try:
        fd = os.open(here, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
            return None
        data = fh.read(EXPECTED_MAX_BYTES + 1)
    if len(data) > EXPECTED_MAX_BYTES:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def pytest_argv(task: Task, *, ini_path: Path, junit_path: Path) -> list[str]:
    """The argv running the hidden tests: test_command + isolation options + test paths.

    `--noconftest` and `-c <ini>` keep the agent's conftest.py / pytest.ini / addopts out;
    `--continue-on-collection-errors` lets the other files run when one fails to import;
    the guard plugin (`-p gyre_pytest_guard`, importable via PYTHONPATH) reports progress
    and enforces a per-test timeout.
    """
    return [*shlex.split(task.test_command), "-p", "gyre_pytest_guard", "--noconftest", "--continue-on-collection-errors",
            "-c", str(ini_path), "--rootdir", ".", f"--junitxml={junit_path}", *sorted(task.test_files)]


def grade(task: Task, *, junit_path: Path, progress_path: Path, exit_code: int | None,
          timed_out: bool, output_tail: str = "") -> Grade:
    """Reward from a finished (or killed) hidden-test run.

    junit_path: pytest's xunit1 report (may be missing when the run was killed).
    progress_path: the guard plugin's JSON lines (`configured`, `collected`, per-test
      `report`). exit_code: pytest's exit status (None if killed). timed_out: the run hit
      test_timeout_s. Raises GradeError when the infrastructure failed (pytest never
      reached `configured`, or a report is unreadable or names no hidden test).
    """
    progress = read_progress(progress_path)
    if not progress.get("configured"):
        tail = output_tail.strip()[-500:]
        raise GradeError(f"pytest did not start (exit code {exit_code}); output: {tail!r}")
    expected = task.expected_tests
    if junit_path.is_file() and not timed_out:
        try:
            cases = parse_junit(junit_path)
        except ET.ParseError as exc:
            raise GradeError(f"junit report unreadable: {exc}") from None
        return _grade_cases(task, cases, expected)
    # Killed (timeout) or died before writing the report: credit what passed so far.
    passed = sum(1 for r in progress.get("reports", []) if r.get("outcome") == "passed")
    total = max(int(progress.get("collected", 0)), expected, passed)
    why = "timeout" if timed_out else f"pytest exited {exit_code} without a report"
    return Grade(reward=passed / total, passed=passed, total=total, note=f"partial: {why}")


def _grade_cases(task: Task, cases: list[dict], expected: int) -> Grade:
    hidden = {p: 0 for p in task.test_files}
    passed = total = 0
    broken: list[str] = []
    for case in cases:
        path = case["file"]
        if path not in hidden:
            continue
        if case["collection_error"]:
            broken.append(path)
            continue
        hidden[path] += 1
        total += 1
        passed += case["outcome"] == "passed"
    for path in broken:
        # The file failed to import (the agent's code is missing or broken): its tests fail.
        total += max(count_tests(task.test_files[path]) - hidden[path], 1)
    if total == 0:
        raise GradeError("junit report holds no hidden test case")
    note = (f"collection error in {', '.join(sorted(broken))} (the hidden tests could not import what they test: "
            "the workspace's code is missing or broken)" if broken else "junit")
    return Grade(reward=passed / total, passed=passed, total=total, note=note)


def parse_junit(path: Path) -> list[dict]:
    """Test cases of a pytest xunit1 junit report.

    Returns [{"file": str relative path, "name": str, "outcome": "passed" | "failed" |
    "error" | "skipped", "collection_error": bool}]. Raises ET.ParseError.
    """
    root = ET.parse(path).getroot()
    out = []
    for case in root.iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                break
        file = case.get("file") or ""
        classname = case.get("classname") or ""
        collection = outcome == "error" and not classname and "collection" in " ".join(
            (c.get("message") or "") for c in case)
        if collection and not file:
            # pytest names the module in `name` (dotted, no .py) for collection errors.
            file = case.get("name", "").replace(".", "/") + ".py"
        out.append({"file": file, "name": case.get("name", ""), "outcome": outcome, "collection_error": collection})
    return out


def read_progress(path: Path) -> dict:
    """Fold the guard plugin's JSON lines into {"configured": bool, "collected": int, "reports": [...]}.

    A missing file or a torn last line (process killed mid-write) is tolerated.
    """
    state: dict[str, Any] = {"configured": False, "collected": 0, "reports": []}
    try:
        lines = Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return state
    for raw in lines:
        try:
            rec = json.loads(raw)
        except json.JSONDecodeError:
            continue
        kind = rec.get("event")
        if kind == "configured":
            state["configured"] = True
        elif kind == "collected":
            state["collected"] = int(rec.get("count", 0))
        elif kind == "report":
            state["reports"].append(rec)
    return state


@dataclasses.dataclass(frozen=True, slots=True)
class GradingPlan:
    """Everything the evaluator needs to run one grading attempt.

    workdir: the graded copy (cwd of pytest, writable by the sandbox uid).
    out_dir: where junit and progress files go. plugin_dir: holds the guard plugin.
    argv: the pytest command. env: variables to add to the sandbox's base environment.
    """

    workdir: Path
    out_dir: Path
    plugin_dir: Path
    junit_path: Path
    progress_path: Path
    argv: list[str]
    env: dict[str, str]


def prepare_grading(task: Task, workspace: Path, scratch: Path, *, per_test_timeout_s: float = 30.0) -> GradingPlan:
    """Copy `workspace` to `scratch/ws`, write the hidden tests and the evaluator's ini into
    the copy (overwriting anything the agent left there), put the guard plugin in
    `scratch/plugin`. `scratch` must not exist. Raises OSError on I/O failure."""
    scratch = Path(scratch)
    workdir, out_dir, plugin_dir = scratch / "ws", scratch / "out", scratch / "plugin"
    scratch.mkdir(parents=True)
    copy_workspace(workspace, workdir)
    write_files(workdir, {**task.test_files, PYTEST_INI_NAME: PYTEST_INI})
    out_dir.mkdir()
    plugin_dir.mkdir()
    shutil.copyfile(GUARD_PLUGIN, plugin_dir / GUARD_PLUGIN.name)
    junit, progress = out_dir / "junit.xml", out_dir / "progress.jsonl"
    argv = pytest_argv(task, ini_path=workdir / PYTEST_INI_NAME, junit_path=junit)
    env = {
        "GYRE_PROGRESS": str(progress),
        "GYRE_PER_TEST_TIMEOUT_S": repr(float(per_test_timeout_s)),
        "PYTHONPATH": str(plugin_dir),
        # `python -m pytest` would otherwise put the cwd first on sys.path, letting a
        # workspace file named pytest.py replace pytest itself.
        "PYTHONSAFEPATH": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    return GradingPlan(workdir=workdir, out_dir=out_dir, plugin_dir=plugin_dir, junit_path=junit,
                       progress_path=progress, argv=argv, env=env)
