"""The package's modules import each other without a cycle.

A cycle makes the import order decide what a module sees (a name half-defined while its module still runs), and
says that two modules are one in two files. Every import counts, as written in the source: at module level, in a
function (a lazy import still ties the two modules), and under `TYPE_CHECKING` (the types still depend on
each other). The graph is read from the source with `ast`, so nothing is imported to build it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pagedserve

PACKAGE = "pagedserve"
ROOT = Path(pagedserve.__file__).parent


def module_name(path: Path) -> str:
    parts = [PACKAGE, *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that the module at `path` imports anywhere in its source (relative imports
    resolved; `from package import name` counts as the submodule `name` where there is one, else the package)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            found.update(f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                         for alias in node.names)
    internal = set()
    for imported in found:  # `import a.b.c` names a.b.c; an unknown tail (a name in a module) is its module's
        while imported and imported not in modules:
            imported = imported.rpartition(".")[0]
        if imported and imported != name:
            internal.add(imported)
    return internal


def import_graph() -> dict[str, set[str]]:
    paths = sorted(ROOT.rglob("*.py"))
    modules = {module_name(path) for path in paths}
    return {module_name(path): imported_modules(path, modules) for path in paths}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as its modules in import order, the first repeated at the end; None if it has none.
    Depth first, iterative (the package is deeper than it should recurse)."""
    done: set[str] = set()
    for root in sorted(graph):
        if root in done:
            continue
        path, on_path = [root], {root}
        stack = [iter(sorted(graph[root]))]
        while stack:
            following = next(stack[-1], None)
            if following is None:
                stack.pop()
                finished = path.pop()
                on_path.discard(finished)
                done.add(finished)
                continue
            if following in on_path:
                return [*path[path.index(following):], following]
            if following not in done:
                path.append(following)
                on_path.add(following)
                stack.append(iter(sorted(graph.get(following, ()))))
    return None


def test_the_resolver_sees_relative_lazy_and_type_only_imports() -> None:
    graph = import_graph()
    executor = "pagedserve.services.executor"
    checks = graph[f"{executor}.step_checks"]
    assert {"pagedserve.services.common.kv_geometry", f"{executor}.held_inputs"} <= checks  # relative, two levels
    # a package's __init__, and a module named by `from package import module`
    assert {"pagedserve.kernels", f"{executor}.model.cpu_decode"} <= graph[f"{executor}.runner"]
    assert f"{executor}.cuda_vmm" in graph[f"{executor}.virtual_kv"]  # imported in a function
    assert f"{executor}.model.llama" in graph[f"{executor}.model.cpu_decode"]  # under TYPE_CHECKING
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_package_has_no_import_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "an import cycle: " + " -> ".join(cycle or ())
