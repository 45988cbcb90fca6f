"""docs/architecture.md names only modules that exist, and tells the life of a step."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("gyre", "handlers", "bus", "schemas", "tests", "ops")


def _module_exists(dotted: str) -> bool:
    """`a.b.c` is a module or package, or an attribute of one (`a.b.C`)."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:n])
        if base.with_suffix(".py").is_file():
            return n >= len(parts) - 2  # at most `module.Class.attr`
        if (base / "__init__.py").is_file():
            return n == len(parts)  # a package's names are its modules
    return False


def test_every_path_and_module_the_page_names_exists():
    text = DOC.read_text("utf-8")
    paths = set(re.findall(r"\b((?:%s)/[\w/]+\.(?:py|json|md|sh|toml|jinja))\b" % "|".join(PACKAGES), text))
    modules = set(re.findall(r"`((?:gyre|handlers|bus|schemas)(?:\.\w+)+)", text))
    assert paths and modules
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    missing += sorted(m for m in modules if not m.startswith("gyre.v1") and not _module_exists(m))  # gyre.v1.*: subjects
    assert missing == []


def test_the_life_of_a_step_has_its_three_walks():
    text = DOC.read_text("utf-8")
    life = text.split("## The life of a step", 1)[1].split("\n## ", 1)[0]
    walks = re.split(r"\n### ", life)[1:]
    titles = [w.splitlines()[0] for w in walks]
    assert len(walks) == 3, titles
    for walk in walks:
        steps = re.findall(r"^\d+\. ", walk, re.M)
        assert len(steps) >= 4, walk.splitlines()[0]
        assert re.search(r"(gyre|handlers)/[\w/]+\.py", walk)
