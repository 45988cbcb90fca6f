"""Task format, loading and validation, workspace seeding and the pure grading rules."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gyre.env.tasks import (
    DEFAULT_TEST_COMMAND,
    GradeError,
    Task,
    bundled_task_sets,
    copy_workspace,
    count_tests,
    grade,
    load_tasks,
    parse_junit,
    prepare_grading,
    seed_workspace,
    write_files,
)

GOOD = {"instance_id": "t1", "problem_statement": "Do it.", "files": {"a.py": "x = 1\n"},
        "test_files": {"test_a.py": "def test_one():\n    assert True\n"}}


def write_jsonl(path: Path, *records, raw: str = "") -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + raw)
    return path


def test_bundled_sets_load_with_enough_tests_each():
    assert {"quickstart", "toy"} <= set(bundled_task_sets())
    quick = load_tasks("quickstart")
    assert len(quick) >= 6
    for t in quick:
        assert 4 <= t.expected_tests <= 8, t.instance_id
        assert t.solution, f"{t.instance_id} has a reference solution"
        assert not set(t.test_files) & set(t.files)
    toy = load_tasks("toy")
    assert all("answer.txt" in t.solution for t in toy)


def test_defaults_and_fields(tmp_path):
    t = load_tasks(write_jsonl(tmp_path / "s.jsonl", GOOD))[0]
    assert t == Task(instance_id="t1", problem_statement="Do it.", files={"a.py": "x = 1\n"},
                     test_files={"test_a.py": "def test_one():\n    assert True\n"})
    assert t.test_command == DEFAULT_TEST_COMMAND and t.timeout_s == 600.0 and t.difficulty == "easy"


def test_comments_blank_lines_and_unknown_fields_are_accepted(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_text("# a comment\n\n" + json.dumps({**GOOD, "repo": "x/y", "base_commit": "abc"}) + "\n")
    assert [t.instance_id for t in load_tasks(path)] == ["t1"]


@pytest.mark.parametrize("change, field, words", [
    ({"instance_id": None}, "instance_id", "missing"),
    ({"problem_statement": "  "}, "problem_statement", "non-empty"),
    ({"test_files": {}}, "test_files", "at least one"),
    ({"test_files": {"t.txt": "x"}}, "test_files", ".py"),
    ({"test_files": {"a.py": "def test_x(): pass\n"}}, "test_files", "collides"),
    ({"test_files": {"test_b.py": "def test_x(:\n"}}, "test_files", "SyntaxError"),
    ({"test_files": {"test_b.py": "def helper(): pass\n"}}, "test_files", "no test functions"),
    ({"files": {"../escape.py": ""}}, "files", "'..'"),
    ({"files": {"/abs.py": ""}}, "files", "relative"),
    ({"files": {"a.py": 3}}, "files", "must be a string"),
    ({"difficulty": "extreme"}, "difficulty", "one of"),
    ({"timeout_s": 0}, "timeout_s", "> 0"),
    ({"tags": "x"}, "tags", "list of strings"),
    ({"instance_id": "has space"}, "instance_id", "letters"),
])
def test_validation_names_line_and_field(tmp_path, change, field, words):
    bad = {**GOOD, **change}
    if change.get("instance_id", "") is None:
        del bad["instance_id"]
    path = write_jsonl(tmp_path / "s.jsonl", {**GOOD, "instance_id": "ok"}, bad)
    with pytest.raises(ValueError) as info:
        load_tasks(path)
    msg = str(info.value)
    assert f"{path}:2:" in msg and field in msg and words in msg, msg


def test_bad_json_duplicate_ids_and_missing_sets(tmp_path):
    with pytest.raises(ValueError, match=r":1: not valid JSON"):
        load_tasks(write_jsonl(tmp_path / "a.jsonl", raw="{nope\n"))
    with pytest.raises(ValueError, match=r":2: instance_id: duplicate .* line 1"):
        load_tasks(write_jsonl(tmp_path / "b.jsonl", GOOD, GOOD))
    with pytest.raises(ValueError, match="contains no tasks"):
        load_tasks(write_jsonl(tmp_path / "c.jsonl", raw="\n# nothing\n"))
    with pytest.raises(ValueError, match="bundled: .*quickstart"):
        load_tasks("no-such-set")


def test_count_tests_handles_classes_and_literal_parametrize():
    src = (
        "import pytest\n"
        "def test_a(): pass\n"
        "def helper(): pass\n"
        "@pytest.mark.parametrize('x', [1, 2, 3])\n"
        "def test_b(x): pass\n"
        "class TestK:\n"
        "    def test_c(self): pass\n"
        "    def other(self): pass\n"
        "class Other:\n"
        "    def test_d(self): pass\n"
    )
    assert count_tests(src) == 1 + 3 + 1
    assert count_tests("def test_(:") == 0


def test_seed_workspace_writes_only_starting_files(tmp_path):
    task = load_tasks("quickstart")[-2]  # fix-stats-bugs: has a starting file
    ws = tmp_path / "ws"
    seed_workspace(task, ws)
    assert sorted(p.name for p in ws.iterdir()) == sorted(task.files)
    with pytest.raises(FileExistsError):
        seed_workspace(task, ws)


def test_write_files_never_follows_agent_symlinks(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "tests").symlink_to(outside)
    (ws / "test_x.py").symlink_to(outside / "victim.py")
    write_files(ws, {"tests/test_y.py": "y", "test_x.py": "x"})
    assert list(outside.iterdir()) == []
    assert (ws / "tests").is_dir() and not (ws / "tests").is_symlink()
    assert (ws / "test_x.py").read_text() == "x"


def test_copy_workspace_keeps_links_as_links_and_skips_fifos(tmp_path):
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "m.py").write_text("m")
    (src / "link").symlink_to("/etc/hostname")
    (src / "dirlink").symlink_to(src / "pkg")
    os.mkfifo(src / "fifo")
    copy_workspace(src, tmp_path / "dst")
    dst = tmp_path / "dst"
    assert (dst / "pkg" / "m.py").read_text() == "m"
    assert os.readlink(dst / "link") == "/etc/hostname"
    assert (dst / "dirlink").is_symlink()
    assert not (dst / "fifo").exists()


def test_prepare_grading_overrides_agent_files(tmp_path):
    task = load_tasks("quickstart")[0]
    ws = tmp_path / "ws"
    ws.mkdir()
    test_name = next(iter(task.test_files))
    (ws / test_name).write_text("def test_fake(): pass\n")
    (ws / ".gyre-pytest.ini").write_text("[pytest]\naddopts = -p evil\n")
    plan = prepare_grading(task, ws, tmp_path / "scratch")
    assert (plan.workdir / test_name).read_text() == task.test_files[test_name]
    assert "evil" not in (plan.workdir / ".gyre-pytest.ini").read_text()
    assert (plan.plugin_dir / "gyre_pytest_guard.py").is_file()
    assert plan.argv[-1] == test_name and "--noconftest" in plan.argv
    assert plan.env["PYTHONSAFEPATH"] == "1"


# ---- grading rules on hand-written reports ------------------------------------------------

TASK = Task(instance_id="g", problem_statement="p", files={},
            test_files={"test_a.py": "def test_1(): pass\ndef test_2(): pass\ndef test_3(): pass\n",
                        "test_b.py": "def test_4(): pass\ndef test_5(): pass\n"})


def junit(tmp_path: Path, *cases: str) -> Path:
    path = tmp_path / "junit.xml"
    path.write_text('<?xml version="1.0"?><testsuites><testsuite>' + "".join(cases) + "</testsuite></testsuites>")
    return path


def case(file: str, name: str, child: str = "") -> str:
    cls = file[:-3]
    return f'<testcase classname="{cls}" name="{name}" file="{file}">{child}</testcase>'


def progress(tmp_path: Path, *records: dict, torn: bool = False) -> Path:
    path = tmp_path / "progress.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + ('{"event": "rep' if torn else ""))
    return path


CONFIGURED = {"event": "configured"}


def test_grade_counts_only_hidden_cases(tmp_path):
    report = junit(tmp_path, case("test_a.py", "test_1"), case("test_a.py", "test_2", '<failure message="x"/>'),
                   case("test_a.py", "test_3", '<skipped message="s"/>'), case("test_b.py", "test_4"),
                   case("test_b.py", "test_5", '<error message="e"/>'), case("test_agent.py", "test_own"))
    g = grade(TASK, junit_path=report, progress_path=progress(tmp_path, CONFIGURED), exit_code=1, timed_out=False)
    assert (g.passed, g.total, g.reward) == (2, 5, 0.4)


def test_collection_error_fails_all_tests_of_that_file(tmp_path):
    broken = '<testcase classname="" name="test_a" file="test_a.py"><error message="collection failure">ImportError</error></testcase>'
    report = junit(tmp_path, broken, case("test_b.py", "test_4"), case("test_b.py", "test_5"))
    g = grade(TASK, junit_path=report, progress_path=progress(tmp_path, CONFIGURED), exit_code=1, timed_out=False)
    assert (g.passed, g.total) == (2, 5) and "collection error in test_a.py" in g.note
    assert parse_junit(report)[0]["collection_error"] is True


def test_timeout_gives_partial_credit_from_progress(tmp_path):
    prog = progress(tmp_path, CONFIGURED, {"event": "collected", "count": 5},
                    {"event": "report", "nodeid": "test_a.py::test_1", "outcome": "passed"},
                    {"event": "report", "nodeid": "test_a.py::test_2", "outcome": "failed"},
                    {"event": "report", "nodeid": "test_a.py::test_3", "outcome": "passed"}, torn=True)
    g = grade(TASK, junit_path=tmp_path / "none.xml", progress_path=prog, exit_code=None, timed_out=True)
    assert (g.passed, g.total, g.reward) == (2, 5, 0.4) and g.note.startswith("partial: timeout")


def test_infrastructure_failures_raise(tmp_path):
    with pytest.raises(GradeError, match="did not start"):
        grade(TASK, junit_path=tmp_path / "none.xml", progress_path=tmp_path / "none.jsonl", exit_code=127,
              timed_out=False, output_tail="python: not found")
    report = junit(tmp_path, case("test_other.py", "test_x"))
    with pytest.raises(GradeError, match="no hidden test case"):
        grade(TASK, junit_path=report, progress_path=progress(tmp_path, CONFIGURED), exit_code=0, timed_out=False)
    (tmp_path / "junit.xml").write_text("<testsuites><testsu")
    with pytest.raises(GradeError, match="unreadable"):
        grade(TASK, junit_path=tmp_path / "junit.xml", progress_path=progress(tmp_path, CONFIGURED), exit_code=0,
              timed_out=False)


def test_toy_rewards_vary_for_random_answers(tmp_path):
    """A random policy must see different rewards inside a group (else advantages are 0)."""
    import random
    import types

    rng = random.Random(0)
    alphabet = "abcdefghijklmnopqrstuvwxyzABC0123456789 .,!\n"
    for task in load_tasks("toy"):
        (name, src), = task.test_files.items()
        rewards = set()
        for i in range(16):
            answer = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 20)))
            d = tmp_path / f"{task.instance_id}-{i}"
            d.mkdir()
            (d / "answer.txt").write_text(answer)
            module = types.ModuleType("toy_tests")
            module.__file__ = str(d / name)
            exec(compile(src, name, "exec"), module.__dict__)
            tests = [v for k, v in vars(module).items() if k.startswith("test_")]
            passed = 0
            for fn in tests:
                try:
                    fn()
                    passed += 1
                except Exception:  # noqa: BLE001 - a failed check
                    pass
            rewards.add(passed / len(tests))
        assert len(rewards) >= 3, (task.instance_id, rewards)


def test_expected_answer_is_graded_without_running_anything(tmp_path):
    from gyre.env.tasks import EXPECTED_MAX_BYTES, TaskError, grade_expected, parse_task

    task = parse_task({"instance_id": "m-1", "problem_statement": "Which digit?", "expected": {"answer.txt": "7"}})
    assert task.test_files == {} and task.expected == {"answer.txt": "7"}
    ws = tmp_path / "ws"
    ws.mkdir()
    assert grade_expected(task, ws).reward == 0.0  # no answer file
    (ws / "answer.txt").write_text(" 7\n")
    g = grade_expected(task, ws)
    assert (g.reward, g.passed, g.total, g.note) == (1.0, 1, 1, "expected")
    (ws / "answer.txt").write_text("77")
    assert grade_expected(task, ws).reward == 0.0
    # a link is never followed, however right its target
    (tmp_path / "secret").write_text("7")
    (ws / "answer.txt").unlink()
    (ws / "answer.txt").symlink_to(tmp_path / "secret")
    assert grade_expected(task, ws).reward == 0.0
    (ws / "answer.txt").unlink()
    (ws / "answer.txt").write_text("7" + " " * EXPECTED_MAX_BYTES)
    assert grade_expected(task, ws).reward == 0.0
    with pytest.raises(TaskError, match="test_files"):
        parse_task({"instance_id": "m-2", "problem_statement": "x"})


def test_majority_tasks_are_the_generators_and_differ_in_answer():
    import collections

    from gyre.env import majority

    tasks = load_tasks("majority")
    assert [t.instance_id for t in tasks] == [r["instance_id"] for r in majority.records()]
    assert [t.expected for t in tasks] == [r["expected"] for r in majority.records()]
    counts = collections.Counter(t.expected["answer.txt"] for t in tasks)
    assert set(counts) == set("0123456789") and max(counts.values()) / len(tasks) < 0.15  # no constant wins
    for t in tasks[:50]:
        digits = t.problem_statement.split(":")[1].strip(" ?").split()
        assert collections.Counter(digits).most_common(1)[0] == (t.expected["answer.txt"], majority.MAJORITY)
    # the warm start's pairs come from another stream than the tasks
    assert not {p for p, _ in majority.examples(200)} & {t.problem_statement for t in tasks}
    from gyre.env.harness import HARNESS_DIR

    assert repr(majority.SYSTEM_PROMPT) in (HARNESS_DIR / "toy_harness.py").read_text().replace('"', "'")
