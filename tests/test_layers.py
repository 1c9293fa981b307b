"""The library's floors: every module imports only from its own floor or lower ones, and no modules import each
other in a loop. Imports inside functions count: a lazy import is still a dependency. The floor plan is drawn in
the README, which must list exactly these floors; a new module goes on the floor of the package it joins."""

from __future__ import annotations

import ast
import re
from pathlib import Path

LIBRARY = Path(__file__).resolve().parent.parent / "clemprm"

# bottom up; a module's floor is that of the longest prefix listed
FLOORS = [
    ("clemprm", "clemprm.config", "clemprm.distributed", "clemprm.modes", "clemprm.records", "clemprm.stats",
     "clemprm.tracking"),
    ("clemprm.games",),
    ("clemprm.play",),
    ("clemprm.models",),
    ("clemprm.checks",),
    ("clemprm.training", "clemprm.model_card"),
    ("clemprm.stages",),
    ("clemprm.search",),
    ("clemprm.rl",),
    ("clemprm.evaluation",),
    ("clemprm.workflow", "clemprm.cli", "clemprm.__main__"),
    ("clemprm.bench",),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(LIBRARY.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def library_modules() -> dict[str, Path]:
    return {module_name(path): path for path in LIBRARY.rglob("*.py")}


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The library modules ``path`` imports anywhere in it (``from package import module`` names the module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known else node.module
                     for alias in node.names]
        else:
            continue
        found |= {name for name in names if name in known}
    return found


def floor_of(module: str) -> int:
    matches = [(len(prefix), floor) for floor, prefixes in enumerate(FLOORS, 1) for prefix in prefixes
               if module == prefix or module.startswith(prefix + ".")]
    assert matches, f"{module} is on no floor: add it to FLOORS (and to the README's floor plan)"
    return max(matches)[1]


def import_graph() -> dict[str, set[str]]:
    modules = library_modules()
    return {name: imported_modules(path, set(modules)) - {name} for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_every_module_imports_only_downward():
    upward = [f"{source} (floor {floor_of(source)}) imports {target} (floor {floor_of(target)})"
              for source, targets in sorted(import_graph().items()) for target in sorted(targets)
              if floor_of(target) > floor_of(source)]
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_no_import_cycles():
    graph = import_graph()
    loops = cycles(graph)
    assert not loops, "import cycles:\n" + "\n".join(
        " <-> ".join(loop) + ": " + "; ".join(f"{a} -> {b}" for a in loop for b in sorted(graph[a]) if b in loop)
        for loop in loops)


def test_the_checker_sees_upward_imports_and_cycles():
    assert floor_of("clemprm.stages.prm") > floor_of("clemprm.models.prm") > floor_of("clemprm.play.engine")
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    graph = import_graph()
    assert "clemprm.models.scoring" in graph["clemprm.models.prm"]         # a module-level import
    assert "clemprm.models.generation" in graph["clemprm.evaluation.evaluate"]   # an import inside a function


def readme_floors() -> list[tuple[str, ...]]:
    """The floors of the README's floor plan, bottom up: per ``floor N`` line, the modules it names (``clemprm (the
    package)``, and paths under ``clemprm/``, whose prefix a line may leave out after its first path)."""
    text = (LIBRARY.parent / "README.md").read_text()
    plan = text.split("## The floor plan", 1)[1].split("```", 2)[1]
    floors = []
    for line in plan.splitlines():
        if not line.startswith("floor "):
            continue   # a floor's description going on
        names = re.findall(r"clemprm \(the package\)|[\w/]+\.py|clemprm/\w+/", line)
        floors.append(tuple("clemprm" if name.startswith("clemprm (") else
                            "clemprm." + name.removeprefix("clemprm/").removesuffix(".py").strip("/").replace("/", ".")
                            for name in names))
    return floors


def test_the_readme_floor_plan_is_the_floors_enforced_here():
    assert readme_floors() == [tuple(floor) for floor in FLOORS]
