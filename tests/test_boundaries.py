"""Package boundaries (STYLE.md "Boundaries"), checked on the source's imports."""
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STDLIB = set(sys.stdlib_module_names)


def _imports(package: str):
    for path in sorted((ROOT / package).rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield path, alias.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                yield path, node.module.split(".")[0]


def test_gyre_and_schemas_never_import_nats_or_aiohttp():
    bad = [(str(p.relative_to(ROOT)), m) for pkg in ("gyre", "schemas") for p, m in _imports(pkg)
           if m in ("nats", "aiohttp", "bus", "handlers")]
    assert bad == []


def test_schemas_import_only_stdlib_and_orjson():
    bad = [(str(p.relative_to(ROOT)), m) for p, m in _imports("schemas")
           if m not in STDLIB and m not in ("orjson", "schemas", "__future__")]
    assert bad == []


def test_only_bus_imports_nats():
    bad = [(str(p.relative_to(ROOT)), m) for pkg in ("gyre", "schemas", "handlers") for p, m in _imports(pkg)
           if m == "nats"]
    assert bad == []


def test_the_check_itself_sees_imports(tmp_path):
    # Guard against a walker that silently finds nothing.
    found = {m for _, m in _imports("bus")}
    assert "nats" in found or not (ROOT / "bus" / "client.py").exists()
    assert "orjson" in {m for _, m in _imports("schemas")}
