"""The code's shape as the README shows it: every module has its row in the module table (and every
row names a module that exists), and no module imports itself back through a circle of others."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
APP = ROOT / "app"


def _modules() -> set[str]:
    """Every module file of the `app` package, as its path from the repository root."""
    return {p.relative_to(ROOT).as_posix() for p in APP.rglob("*.py") if p.name != "__init__.py"}


def _readme_rows() -> set[str]:
    """The modules the README's module table names: `app/x.py` in the shared section, `x.py` under
    the section of package `app/p/`."""
    table = re.search(r"^\| module \| does \|\n(.*?)\n\n", (ROOT / "README.md").read_text(), re.M | re.S)
    assert table, "README.md has no module table"
    named, package = set(), "app/"
    for row in table.group(1).splitlines():
        first = row.split("|")[1]
        section = re.fullmatch(r"\s*\*\*`(app/\w+/)`\*\*\s*", first)
        if section:
            package = section.group(1)
            continue
        for name in re.findall(r"`([\w/]+\.py)`", first):
            named.add(name if name.startswith("app/") else package + name)
    return named


def test_every_module_has_its_row_in_the_readme_module_table_and_every_row_a_module():
    modules, rows = _modules(), _readme_rows()
    assert not modules - rows, f"modules without a README row: {sorted(modules - rows)}"
    assert not rows - modules, f"README rows naming no module: {sorted(rows - modules)}"


def _imports_at_load() -> dict[str, set[str]]:
    """{module: the `app` modules its top level imports}: what importing it imports (imports inside
    functions run later, when called)."""
    files = {
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
        for p in APP.rglob("*.py")
    }
    graph = {}
    for name, path in files.items():
        found = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "app":
                for alias in node.names:
                    submodule = f"{node.module}.{alias.name}"
                    found.add(submodule if submodule in files else node.module)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.split(".")[0] == "app")
        graph[name] = {m for m in found if m in files and m != name}
    return graph


def test_no_module_imports_itself_back_through_a_circle_of_others():
    graph = _imports_at_load()
    circles, state = [], {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for imported in sorted(graph[module]):
            if state.get(imported) == "open":
                circles.append(" → ".join([*path[path.index(imported) :], imported]))
            elif imported not in state:
                visit(imported, [*path, imported])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not circles, "import circles:\n" + "\n".join(circles)
