"""The package's shape: modules import one way (no circles, lazy imports inside functions included), the decode
state's counters move only in its own module, one DFlash2 cycle reads few files; the GPU benches import what
exists."""

import ast
import re
import sys
from pathlib import Path

import pytest

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


def files_of_one_cycle(engine, prompt: list[int], tokens: int) -> dict[str, set[str]]:
    """The package's files (relative to it) whose functions run in one decode cycle, each with their names: from the
    proposer's third proposal to its fourth, the steady state past prefill and the first cycles, of Engine.stream
    (the tokens alone: generate's text and stops, models/text.py, are the caller's)."""
    entry = "propose_tree" if engine.proposer.tree_budget else "propose"
    proposer_file = sys.modules[type(engine.proposer).__module__].__file__
    seen: dict[str, set[str]] = {}
    proposals = 0

    def trace(frame, event, arg):
        nonlocal proposals
        path = frame.f_code.co_filename
        if event == "call" and frame.f_code.co_name == entry and path == proposer_file:
            proposals += 1
        # a generator resumed (the decode loop, Engine.stream) shows as its return: counted too
        if event in ("call", "return") and proposals == 3 and path.startswith(str(PACKAGE)):
            seen.setdefault(str(Path(path).relative_to(PACKAGE)), set()).add(frame.f_code.co_name)

    sys.setprofile(trace)
    try:
        for _ in engine.stream(prompt, tokens, stop_at_eos=False):
            pass
    finally:
        sys.setprofile(None)
    assert proposals > 3, proposals  # the cycle traced ended
    return seen


@pytest.mark.parametrize("budget", [0, 12])
def test_a_dflash2_cycle_reads_at_most_15_files_outside_the_kernels(tiny_checkpoint, tiny_drafter, budget):
    """A newcomer follows one DFlash2 cycle, chain or tree, through at most 15 files of engine, model, layers and
    drafter; the ops it calls live in kernels/, each beside its reference."""
    from blockspec import Engine

    target = tiny_checkpoint(planted=True)
    engine = Engine.load(target, device="cpu", compute_dtype="float32", context_length=256, mode="dflash2",
                         dflash2_model=str(tiny_drafter(target)), dflash2_tree_budget=budget)
    seen = files_of_one_cycle(engine, engine.tokenizer.encode("hello world"), 40)
    outside = sorted(f for f in seen if not f.startswith("kernels/"))
    assert {"engine/decode.py", "engine/state.py", "engine/target.py", "drafter/model.py",
            "models/qwen3_5.py"} <= set(outside), outside
    assert ("propose_tree" if budget else "propose") in seen["engine/dflash2.py"]
    assert len(outside) <= 15, outside
