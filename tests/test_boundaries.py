"""Package boundaries (STYLE.md "Boundaries"), checked on the source's imports."""
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STDLIB = set(sys.stdlib_module_names)


def _modules(package: str):
    """(file, imported module's full dotted name) for every import under `package`; a
    `from pkg import name` also yields `pkg.name`, which may be a module."""
    for path in sorted((ROOT / package).rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield path, alias.name
            elif isinstance(node, ast.ImportFrom) and (node.module or node.level):
                if node.level:  # relative (`from .x import y`, `from .. import y`): resolve against the file's package
                    parts = path.relative_to(ROOT).with_suffix("").parts[:-node.level]
                    base = ".".join((*parts, node.module) if node.module else parts)
                else:
                    base = node.module
                yield path, base
                for alias in node.names:
                    yield path, f"{base}.{alias.name}"


def _imports(package: str):
    for path, module in _modules(package):
        yield path, module.split(".")[0]


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


def test_control_is_pure_scheduling_code():
    # The simulator drives gyre/control/ unchanged, so it may not need an engine, a
    # trainer or an event loop.
    banned = ("gyre.serving", "gyre.learning", "torch", "asyncio", "transformers")
    bad = [(str(p.relative_to(ROOT)), m) for p, m in _modules("gyre/control")
           if any(m == b or m.startswith(b + ".") for b in banned)]
    assert bad == []


def test_gyre_never_imports_handlers():
    assert [(str(p.relative_to(ROOT)), m) for p, m in _imports("gyre") if m == "handlers"] == []


def test_benchmarks_are_imported_only_by_the_cli_and_tests():
    allowed = {ROOT / "handlers" / "cli.py"}
    bad = [(str(p.relative_to(ROOT)), m) for pkg in ("gyre", "bus", "schemas", "handlers") for p, m in _modules(pkg)
           if (m == "handlers.bench" or m.startswith("handlers.bench."))
           and p not in allowed and ROOT / "handlers" / "bench" not in p.parents]
    assert bad == []


def test_the_walker_resolves_full_names():
    found = {m for _, m in _modules("handlers")}
    assert "handlers.proxy.daemon.Config" in found or "handlers.proxy.daemon" in found
    assert any(m.startswith("gyre.serving.") for m in found)


def test_the_walker_resolves_relative_imports(tmp_path, monkeypatch):
    pkg = tmp_path / "gyre" / "control"
    pkg.mkdir(parents=True)
    (pkg / "x.py").write_text("from .. import serving\nfrom ..learning import gspo\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert {m for _, m in _modules("gyre/control")} >= {"gyre", "gyre.serving", "gyre.learning", "gyre.learning.gspo"}
