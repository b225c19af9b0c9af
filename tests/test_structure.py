"""The package's shape: modules import one way (no circles, lazy imports inside functions included), and the
decode state's counters move only in its own module; the GPU benches import what exists."""

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "blockspec"


def module_name(path: Path) -> str:
    root = next(p for p in path.parents if p.name == "blockspec").parent
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str]) -> set[str]:
    """The blockspec modules `path` imports anywhere in its body (a name imported from a package counts as its
    submodule when there is one)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        found |= {t for t in targets if t in modules and t != name}
    return found


def import_graph(package: Path) -> dict[str, set[str]]:
    files = {module_name(p): p for p in package.rglob("*.py")}
    return {name: imports(path, set(files)) for name, path in files.items()}


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` (module -> modules it imports), or None: a depth-first search in which a module
    met again while still on the path closes a circle."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (circle := visit(nxt)):
                return circle
        stack.pop()
        state[node] = "done"
        return None
    return next((c for node in sorted(graph) if node not in state and (c := visit(node))), None)


def test_no_import_circles():
    graph = import_graph(PACKAGE)
    assert "blockspec.cli_common" in graph["blockspec.bench"]  # the walk sees imports, lazy ones too
    assert "blockspec.fixtures.synthetic" in graph["blockspec.bench"]
    circle = find_circle(graph)
    assert circle is None, "import circle: " + " -> ".join(circle)


def test_the_circle_finder_finds_a_lazy_circle(tmp_path):
    package = tmp_path / "blockspec"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "a.py").write_text("def f():\n    from ..b import g\n")
    (package / "b.py").write_text("from blockspec.sub import a\n")
    assert find_circle(import_graph(package)) in (["blockspec.b", "blockspec.sub.a", "blockspec.b"],
                                  ["blockspec.sub.a", "blockspec.b", "blockspec.sub.a"])


def test_decode_state_counters_move_in_its_module_only():
    writes = re.compile(r"state\.(length|pending)\s*[-+]?=[^=]")
    offenders = [f"{p.relative_to(PACKAGE.parent)}:{i}" for p in PACKAGE.rglob("*.py")
                 for i, line in enumerate(p.read_text().splitlines(), 1) if writes.search(line)]
    assert offenders == []


def test_bench_scripts_import_what_exists():
    """The GPU benches run only on the device machine: every `from blockspec... import name` they hold must resolve
    here, so that a moved module or renamed function fails in CI rather than after the device is started."""
    import importlib.util

    missing = []
    for path in sorted((PACKAGE.parent / "bench").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "blockspec":
                try:
                    module = importlib.import_module(node.module)
                except ImportError as e:
                    missing.append(f"{path.name}: {node.module} ({e})")
                    continue
                missing += [f"{path.name}: {node.module}.{a.name}" for a in node.names
                            if not hasattr(module, a.name) and importlib.util.find_spec(f"{node.module}.{a.name}")
                            is None]
    assert missing == []
