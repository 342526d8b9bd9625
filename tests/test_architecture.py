"""The house rules, checked: the import graph has floors and no circles, modules and functions stay
small enough to read in one sitting, and the tree is formatted.

The import graph counts every `import` that runs: at module level and inside functions. Imports
under `if TYPE_CHECKING:` never run (they name types for annotations) and are left out.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "slimish"

# Rooms from the ground floor up: a module may import its own room or a room on a lower floor.
FLOORS = [
    # the ground: protocol shapes, the sample, small shared utilities
    {
        "slimish",
        "protocol",
        "types",
        "net",
        "serving",
        "loop_thread",
        "distributed",
        "plugins",
        "processes",
        "schema",
        "flags",
        "moe",
        "batch_invariant",
        "colocate",
    },
    {"formats", "tiny_model"},
    {"client", "engine"},
    {"router"},
    {"buffer", "metrics"},
    {"gateway"},
    {"rollout"},
    {"compat"},
    {"trainer"},
    {"launch"},
    {"config", "tinker"},
    {"train", "view", "view_page", "plot", "docs_config"},
    {"cli"},
]
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def room(module: str) -> str:
    """`slimish.engine.scheduler` -> `engine`; `slimish.train` -> `train`; `slimish` -> `slimish`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def floor(module: str) -> int:
    name = room(module)
    for level, rooms in enumerate(FLOORS):
        if name in rooms:
            return level
    raise AssertionError(f"{module}: room {name!r} is on no floor of tests/test_architecture.py FLOORS")


def runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that can run (not under `if TYPE_CHECKING:`)."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def targets(module: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The slimish modules one import statement loads (the deepest existing module of each name)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module.split(".") if MODULES[module].name == "__init__.py" else module.split(".")[:-1]
            package = package[: len(package) - node.level + 1]
            base = ".".join(package + ([node.module] if node.module else []))
        names = [base] + [f"{base}.{alias.name}" for alias in node.names]
    found = set()
    for name in names:
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        if name and name != module:
            found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in MODULES.items():
        for node in runtime_imports(ast.parse(path.read_text())):
            graph[module] |= targets(module, node)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in MODULES:
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_has_no_circles() -> None:
    assert circles(import_graph()) == []


def test_no_import_points_up_a_floor() -> None:
    up = [
        f"{a} -> {b}"
        for a, bs in sorted(import_graph().items())
        for b in sorted(bs)
        if room(a) != room(b) and floor(b) > floor(a)
    ]
    assert up == []


def test_modules_and_functions_fit_one_sitting() -> None:
    long_modules = []
    long_functions = []
    for module, path in MODULES.items():
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            long_modules.append(f"{module}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long_functions.append(f"{module}.{node.name}: {length} lines")
    assert (long_modules, long_functions) == ([], [])


@pytest.mark.parametrize("command", [["format", "--check"], ["check"]], ids=["formatted", "linted"])
def test_the_tree_is_formatted_and_linted(command: list[str]) -> None:
    """`ruff check` runs what pyproject.toml selects: unused or undefined names and import order."""
    ruff = Path(sys.executable).with_name("ruff")
    if not ruff.exists():
        pytest.fail("ruff is not installed in the venv: pip install -e '.[dev]'")
    done = subprocess.run([str(ruff), *command, "."], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


# The engine's HTTP layers: they call `Engine`'s methods, never its scheduler or runner.
ENGINE_ROUTES = ["api_generate", "api_info", "api_lora", "api_weights", "http", "openai_api", "server"]


def test_engine_routes_call_the_engine_never_its_scheduler_or_runner() -> None:
    reach_ins = [
        f"slimish.engine.{name}:{node.lineno}: .{node.attr}"
        for name in ENGINE_ROUTES
        for node in ast.walk(ast.parse((PACKAGE / "engine" / f"{name}.py").read_text()))
        if isinstance(node, ast.Attribute) and node.attr.lstrip("_") in ("scheduler", "runner")
    ]
    assert reach_ins == []


def test_no_two_classes_share_a_name() -> None:
    """One name, one class: a reader (and a grep) never has to ask which `Request` is meant. The
    slime namespace is exempt: its names are slime's, for slime users' code."""
    where: dict[str, list[str]] = defaultdict(list)
    for module, path in MODULES.items():
        if ".slime_namespace" in module:
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                where[node.name].append(module)
    assert {name: modules for name, modules in where.items() if len(modules) > 1} == {}


def test_the_schedulers_scopes_and_order_name_test_files_that_exist() -> None:
    """conftest.py's SCOPES and LONGEST steer `make test`'s workers by file name: a renamed file
    would silently fall out of its scope (its engines started twice again) or of the order."""
    from conftest import LONGEST, SCOPE_OF, SCOPES

    root = Path(__file__).parents[1]
    named = [*SCOPE_OF, *(name for name in LONGEST if name not in SCOPES)]
    assert [name for name in named if not (root / name).is_file()] == []
