"""docs/architecture.md names only modules that exist, and tells the life of a step;
docs/recipes.md documents every recipe key with the type and default the code gives it.

The commands and links of README.md and docs/ are checked in tests/test_doc_commands.py."""
import ast
import re
import tomllib
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
RECIPES = ROOT / "docs" / "recipes.md"
PACKAGES = ("gyre", "handlers", "bus", "schemas", "tests", "ops")


def _names(body) -> set[str]:
    """Names a module or class body defines: functions, classes, assignments, imports."""
    names = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def _module_exists(dotted: str) -> bool:
    """`a.b.c` is a module or package, or a name a module defines (`a.b.func`,
    `a.b.Class.attr`)."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:n])
        if base.with_suffix(".py").is_file():
            body = ast.parse(base.with_suffix(".py").read_text("utf-8")).body
            for name in parts[n:]:
                if name not in _names(body):
                    return False
                body = next((c.body for c in body if isinstance(c, ast.ClassDef) and c.name == name), [])
            return True
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


def _recipe_rows() -> dict[str, tuple[str, str, str]]:
    """docs/recipes.md's rows `| `table.key` | type | `default` | meaning |`, by key."""
    rows = {}
    for line in RECIPES.read_text("utf-8").splitlines():
        m = re.fullmatch(r"\| `(\w+\.\w+)` \| ([^|]+) \| `([^`]+)` \| (.+) \|", line)
        if m:
            assert m[1] not in rows, f"{m[1]} documented twice"
            rows[m[1]] = (m[2].strip(), m[3], m[4])
    return rows


def test_the_recipes_page_documents_every_key_with_its_type_and_default():
    from gyre.config import recipe_keys

    rows = _recipe_rows()
    keys = recipe_keys()
    # A key added to (or removed from) the typed config without its row fails here.
    names = {key for key, _, _ in keys}
    assert {"undocumented": sorted(names - set(rows)), "not in the code": sorted(set(rows) - names)} == {
        "undocumented": [], "not in the code": []}
    wrong = []
    for key, hint, default in keys:
        kind, literal, meaning = rows[key]
        options = typing.get_args(hint) if typing.get_origin(hint) is typing.Literal else ()
        expected_kind = "string" if options else {int: "int", float: "float", str: "string", bool: "bool"}[hint]
        value = tomllib.loads(f"v = {literal}")["v"]  # the default as a recipe would spell it
        if kind != expected_kind:
            wrong.append(f"{key}: type {kind!r}, the code says {expected_kind!r}")
        if (type(value), value) != (type(default), default):
            wrong.append(f"{key}: default {literal}, the code says {default!r}")
        wrong += [f"{key}: option {o!r} not named" for o in options if f"`{o}`" not in meaning]
        if len(meaning.strip()) < 10:
            wrong.append(f"{key}: no meaning")
    assert wrong == []
