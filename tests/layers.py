"""The checks that the imports keep the layer order written in docs/DESIGN.md §2.

`read_layers` reads the order from DESIGN (the numbered list between `<!-- layers -->` and
`<!-- /layers -->`: it is written once, there); the other functions walk every module's
syntax tree (function-level and type-checking imports included) and find the imports that go
up the order, the cycles between modules and the function-level imports that do not say why.
`tests/test_layers.py` runs them on `src/harnessrl`, and on small made-up packages to show
that each check fails when it should.

Rules:
  * a module may import a module of its own layer or of a lower one, never a higher one;
  * within a layer, modules of different folders may import each other only in the order the
    layer lists them (its first entry lowest), so two folders never import each other;
  * no cycle between modules (each import that runs, at any depth of the file, is an edge;
    one under `if TYPE_CHECKING:` is not);
  * a function-level import says why on its line or the line above (`# lazy: <reason>`): a
    heavy or optional dependency (torch, transformers, vllm, ray, peft, playwright, ...), a
    module that pulls one in, or a command's modules loaded when it runs (`cli.py`).

What it does not do: check third-party imports (only that a function-level one says why).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

Layers = tuple[tuple[str, ...], ...]
"""Bottom to top: each entry names top-level modules or folders of the package."""


def read_layers(design: Path) -> Layers:
    """The layer order of DESIGN §2: each numbered line between `<!-- layers -->` and
    `<!-- /layers -->` is a layer, `N. [label:] name, name/, ...` (a trailing `/` marks a folder).

    Raises:
        ValueError: no such block, or a layer with no name.
    """
    text = design.read_text(encoding="utf-8")
    if "<!-- layers -->" not in text or "<!-- /layers -->" not in text:
        raise ValueError(f"{design}: no <!-- layers --> ... <!-- /layers --> block")
    block = text.split("<!-- layers -->", 1)[1].split("<!-- /layers -->", 1)[0]
    layers = []
    for line in block.splitlines():
        line = line.strip()
        head, _, rest = line.partition(". ")
        if not head.isdigit():
            continue
        rest = rest.split(":", 1)[1] if ":" in rest.split(",")[0] else rest
        names = tuple(n.strip().strip("`").rstrip("/") for n in rest.split("(")[0].split(",") if n.strip())
        if not names:
            raise ValueError(f"{design}: layer {head} names nothing")
        layers.append(names)
    return tuple(layers)


@dataclass(frozen=True, slots=True)
class ImportEdge:
    """One import statement: `module` (dotted) imports `target` (dotted) at `line`."""

    module: str
    target: str
    line: int
    function_level: bool
    type_only: bool
    """Under `if TYPE_CHECKING:` (never run)."""
    lazy_reason: str | None
    """The `# lazy:` text on the import's line or the line above, if any."""


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Dotted name -> file of every module under `root` (the package directory `package`)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def import_edges(root: Path, package: str) -> Iterator[ImportEdge]:
    """Every import of a module of `package` by a module under `root`, at any depth."""
    modules = module_names(root, package)
    for name, path in modules.items():
        source = path.read_text(encoding="utf-8")
        lines = source.splitlines()
        tree = ast.parse(source)
        in_function = _function_level_nodes(tree)
        type_only = _type_checking_nodes(tree)
        for node in ast.walk(tree):
            for target in _targets(node, name, path, modules, package):
                yield ImportEdge(name, target, node.lineno, id(node) in in_function, id(node) in type_only,
                                 _lazy_reason(lines, node.lineno, getattr(node, "end_lineno", node.lineno)))


def layer_of(module: str, package: str, layers: Layers) -> tuple[int, int] | None:
    """(layer index, position within the layer) of a dotted module name; None for the package
    itself or a name outside `layers`."""
    parts = module.split(".")
    if parts[0] != package or len(parts) < 2:
        return None
    for i, layer in enumerate(layers):
        if parts[1] in layer:
            return i, layer.index(parts[1])
    return None


def upward_imports(edges: Sequence[ImportEdge], package: str, layers: Layers) -> list[str]:
    """The imports that break the order (module docstring), one line each; a module outside
    `layers` is reported too."""
    bad = []
    for e in edges:
        here, there = layer_of(e.module, package, layers), layer_of(e.target, package, layers)
        if e.target == package:
            continue
        if here is None or there is None:
            unknown = e.module if here is None else e.target
            bad.append(f"{e.module}:{e.line} -> {e.target}: {unknown} is in no layer")
            continue
        same_folder = e.module.split(".")[1] == e.target.split(".")[1]
        if there > here and not same_folder:
            bad.append(f"{e.module}:{e.line} -> {e.target}: imports upward (layer {there} above {here})")
    return bad


def cycles(edges: Sequence[ImportEdge]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan's algorithm), each sorted;
    type-only imports (`if TYPE_CHECKING:`) are no edge, since they never run."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        if e.target != e.module and not e.type_only:
            graph.setdefault(e.module, set()).add(e.target)
            graph.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def unexplained_lazy_imports(root: Path) -> list[str]:
    """Function-level import statements (of any package) without a `# lazy:` reason."""
    bad = []
    for path in sorted(root.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        lines = source.splitlines()
        tree = ast.parse(source)
        in_function = _function_level_nodes(tree)
        for node in ast.walk(tree):
            if id(node) in in_function and not _lazy_reason(lines, node.lineno, node.end_lineno):
                bad.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    return bad


def _function_level_nodes(tree: ast.AST) -> set[int]:
    found: set[int] = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.update(id(n) for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom)))
    return found


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    found: set[int] = set()
    for block in ast.walk(tree):
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test):
            found.update(id(n) for stmt in block.body for n in ast.walk(stmt) if isinstance(n, (ast.Import, ast.ImportFrom)))
    return found


def _lazy_reason(lines: list[str], first: int, last: int | None) -> str | None:
    for number in (last or first, first, first - 1):
        if 1 <= number <= len(lines) and "# lazy:" in lines[number - 1]:
            reason = lines[number - 1].split("# lazy:", 1)[1].strip()
            return reason or None
    return None


def _targets(node: ast.AST, name: str, path: Path, modules: dict[str, Path], package: str) -> list[str]:
    """The modules of `package` an import node names (a `from X import y` that is a submodule
    counts as `X.y`)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == package]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        base = base[: len(base) - node.level + 1]
        module = ".".join([*base, *([node.module] if node.module else [])])
    else:
        module = node.module or ""
    if module.split(".")[0] != package:
        return []
    subs = [f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in modules]
    return subs or [module]
