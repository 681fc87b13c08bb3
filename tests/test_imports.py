"""Import contract: no import circles in a package, and the services never import one another.

The sources are parsed with ast, never imported. Every import counts as an edge between the
project's modules: module-level or inside a function, under `if TYPE_CHECKING:` too,
absolute or relative. `from a import b` points at the module a.b when there is one, else at
a; `import a.b` points at a.b (the parent packages it runs on the way are not counted).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import ROOT

PACKAGES = ("common", "edge", "worker", "scheduler", "tools")
SERVICES = ("edge", "worker", "scheduler")
#: The import namespace the source folders are mapped into (pyproject's package-dir).
NAMESPACE = "omnifabric"


def module_name(root: Path, path: Path, namespace: str = "") -> str:
    """edge/ws.py -> edge.ws; worker/engines/__init__.py -> worker.engines; each under
    `namespace` when one is given (omnifabric.edge.ws)."""
    parts = path.relative_to(root).with_suffix("").parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    return ".".join((namespace, *parts) if namespace else parts)


def package_of(module: str) -> str:
    """omnifabric.edge.ws -> edge."""
    return module.removeprefix(f"{NAMESPACE}.").split(".")[0]


def imported_names(path: Path, module: str) -> set[str]:
    """The dotted names `path` (module `module`) imports, relative imports made absolute;
    `from a import b` gives a.b (b may be a submodule or a name defined in a)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # from . import x, from ..a import x
                anchor = package.rsplit(".", node.level - 1)[0]
                base = f"{anchor}.{base}" if base else anchor
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def resolve(name: str, modules: set[str]) -> str | None:
    """The longest prefix of `name` that is one of `modules` (None: not the project's)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def project_files(root: Path, packages: tuple[str, ...], namespace: str = "") -> dict[str, Path]:
    """Module name -> source file, for every module of `packages` (folders under `root`)."""
    return {
        module_name(root, p, namespace): p for pkg in packages for p in (root / pkg).rglob("*.py")
    }


def build_graph(root: Path, packages: tuple[str, ...], namespace: str = "") -> dict[str, set[str]]:
    """Module -> the modules of `packages` (folders under `root`) it imports."""
    files = project_files(root, packages, namespace)
    graph = {}
    for module, path in files.items():
        targets = {resolve(name, set(files)) for name in imported_names(path, module)}
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, each sorted."""
    reach = {m: reachable(graph, m) for m in graph}
    found = {frozenset(w for w in reach[m] if m in reach[w]) for m in graph if m in reach[m]}
    return sorted(sorted(circle) for circle in found)


def describe(found: list[list[str]], graph: dict[str, set[str]]) -> str:
    """Each circle's modules, with what each imports inside the circle."""
    lines = []
    for circle in found:
        lines.append("circle: " + ", ".join(circle))
        lines += [f"  {m} -> {', '.join(sorted(graph[m] & set(circle)))}" for m in circle]
    return "\n".join(lines)


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return build_graph(ROOT, PACKAGES, NAMESPACE)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_circles(graph, package):
    found = [c for c in circles(graph) if any(package_of(m) == package for m in c)]
    assert not found, describe(found, graph)


def test_common_is_a_leaf(graph):
    """omnifabric.common is shared by the services, so it imports none of them (nor tools)."""
    reached = {
        f"{module} -> {target}"
        for module, targets in graph.items()
        if package_of(module) == "common"
        for target in targets
        if package_of(target) != "common"
    }
    assert not reached, "\n".join(sorted(reached))


def test_services_do_not_import_each_other(graph):
    """edge, worker and scheduler share only generated code (omni); tools may import them."""
    crossings = [
        f"{module} -> {target}"
        for module, targets in sorted(graph.items())
        for target in sorted(targets)
        if {package_of(module), package_of(target)} <= set(SERVICES)
        and package_of(module) != package_of(target)
    ]
    assert not crossings, "\n".join(crossings)


def imports_of(root: Path, packages: tuple[str, ...], target: str) -> list[str]:
    """`module -> name` for every import of `target` or a module under it by a module of
    `packages` (folders under `root`): module-level or inside a function."""
    return [
        f"{module} -> {name}"
        for module, path in sorted(project_files(root, packages, NAMESPACE).items())
        for name in sorted(imported_names(path, module))
        if name == target or name.startswith(f"{target}.")
    ]


def test_dependencies_point_one_way():
    """tests -> tools -> services, never back: nothing under tools imports the tests (a tool
    runs from an installed package, where tests/ is not), and no service imports tools or
    tests. (Running pytest on tests/ in a subprocess is no import.)"""
    found = imports_of(ROOT, ("tools",), "tests")
    found += imports_of(ROOT, SERVICES, "tests")
    found += imports_of(ROOT, SERVICES, f"{NAMESPACE}.tools")
    assert not found, "\n".join(found)


def test_import_direction_check_finds_tests_in_a_function(tmp_path):
    """The check above sees an import of tests inside a function, as soak's once were."""
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "soak.py").write_text(
        "import json\n\n\ndef _stack():\n    from tests.stack import Stack\n\n    return Stack\n"
    )
    (tmp_path / "tools" / "plain.py").write_text("from omnifabric.tools import soak\n")
    assert imports_of(tmp_path, ("tools",), "tests") == [
        "omnifabric.tools.soak -> tests.stack.Stack"
    ]


#: What a dialect (a translator: edge/dialects/*.py) may not import: it holds no socket, no
#: event loop, no fabric call and no transport.
NOT_IN_DIALECTS = ("asyncio", "socket", "ssl", "grpc", "websockets", "selectors")


def top_level_imports(path: Path) -> set[str]:
    """The first component of every name `path` imports (absolute imports only)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_dialects_hold_no_io(graph):
    """No dialect file, nor any project module it reaches, imports a socket, asyncio, gRPC
    or WebSocket library: translators are plain functions of their input."""
    dialect_files = sorted((ROOT / "edge" / "dialects").glob("*.py"))
    assert len(dialect_files) >= 8, dialect_files
    files = project_files(ROOT, PACKAGES, NAMESPACE)
    problems = []
    for path in dialect_files:
        module = module_name(ROOT, path, NAMESPACE)
        for reached in sorted({module} | reachable(graph, module)):
            banned = top_level_imports(files[reached]) & set(NOT_IN_DIALECTS)
            if banned:
                problems.append(f"{module} reaches {reached}, which imports {sorted(banned)}")
    assert not problems, "\n".join(problems)


def test_graph_covers_the_project(graph):
    """The contract looks at real imports: every package has modules, and known edges show."""
    assert {package_of(m) for m in graph} == set(PACKAGES)
    assert "omnifabric.worker.engine" in graph["omnifabric.worker.session"]
    # inside a function:
    assert "omnifabric.worker.engines.synthetic" in graph["omnifabric.worker.engines.registry"]


def test_everything_imports_through_the_namespace():
    """The source folders are importable only as omnifabric.* once installed: an import of a
    bare edge/worker/scheduler/tools/omni would work in the source tree and fail (or pick up
    someone else's package) in an installed one."""
    bare = (*PACKAGES, "omni")
    found = []
    for path in sorted(ROOT.glob("*/**/*.py")):
        if path.parts[len(ROOT.parts)] not in (*PACKAGES, "tests"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            found += [
                f"{path.relative_to(ROOT)}:{node.lineno} {name}"
                for name in names
                if name.split(".")[0] in bare
            ]
    assert not found, "\n".join(found)


def test_installed_packages_are_all_in_the_namespace():
    """pyproject lists omnifabric.* packages only, each mapped to its source folder: nothing
    generic (edge, tools, ...) lands at the top of site-packages."""
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert all(p.startswith(f"{NAMESPACE}.") for p in setuptools["packages"])
    for package, folder in setuptools["package-dir"].items():
        assert package.startswith(f"{NAMESPACE}.") and (ROOT / folder).is_dir(), package
    assert not (ROOT / NAMESPACE / "__init__.py").exists()  # a namespace package


def test_graph_builder_finds_a_known_circle(tmp_path):
    sources = {
        "pkg/__init__.py": "from .d import *\n",
        "pkg/a.py": "from . import b\nimport os\n",
        "pkg/b.py": "def f():\n    from pkg.sub.c import g\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/c.py": (
            "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from ..a import X\n"
        ),
        "pkg/d.py": "import pkg.a\n",
    }
    for name, text in sources.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)

    graph = build_graph(tmp_path, ("pkg",))

    assert graph == {
        "pkg": {"pkg.d"},
        "pkg.a": {"pkg.b"},  # relative import of a submodule; os is not the project's
        "pkg.b": {"pkg.sub.c"},  # inside a function; g is a name in pkg.sub.c
        "pkg.sub": set(),
        "pkg.sub.c": {"pkg.a"},  # two levels up, under TYPE_CHECKING
        "pkg.d": {"pkg.a"},
    }
    assert circles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c"]]
    assert "circle: pkg.a, pkg.b, pkg.sub.c" in describe(circles(graph), graph)
    del graph["pkg.sub.c"]
    assert circles(graph) == []
