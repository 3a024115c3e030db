"""The layer order of docs/DESIGN.md §2 holds for every module of src/harnessrl: no import goes
up, no two modules import each other (directly or around a loop), and every function-level
import says why. Each check is also run on a small made-up package to show that it fails when
it should."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from layers import cycles, import_edges, read_layers, unexplained_lazy_imports, upward_imports

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src" / "harnessrl"
DESIGN = REPO / "docs" / "DESIGN.md"


def test_design_names_every_folder_and_top_level_module_once() -> None:
    layers = read_layers(DESIGN)
    names = [n for layer in layers for n in layer]
    assert len(names) == len(set(names)), "a name in two layers"
    on_disk = {p.stem for p in SRC.glob("*.py") if p.stem != "__init__"} | {
        p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert on_disk - set(names) == set(), "in src/harnessrl but in no layer of DESIGN §2"
    assert set(names) - on_disk == set(), "in DESIGN §2 but not in src/harnessrl"


def test_no_module_imports_upward() -> None:
    edges = list(import_edges(SRC, "harnessrl"))
    assert len(edges) > 300, "the walk found the imports"
    assert upward_imports(edges, "harnessrl", read_layers(DESIGN)) == []


def test_no_import_cycle_between_modules() -> None:
    assert cycles(list(import_edges(SRC, "harnessrl"))) == []


def test_every_function_level_import_says_why() -> None:
    assert unexplained_lazy_imports(SRC) == []


def test_the_proxy_imports_only_the_chat_layer_and_the_engine_seam_below_it() -> None:
    below = {e.target for e in import_edges(SRC, "harnessrl")
             if e.module.startswith("harnessrl.proxy.") and not e.target.startswith("harnessrl.proxy")}
    engine = {t for t in below if t.startswith("harnessrl.engine")}
    assert engine <= {"harnessrl.engine", "harnessrl.engine.base"}, engine
    assert {t.split(".")[1] for t in below} <= {"engine", "chat", "errors", "types", "jsonl"}, below


TRAIN_FUNCTION_LINES = 80  # the training loop's parts stay readable top to bottom (DESIGN §2, train/)


def long_functions(root: Path, limit: int) -> list[str]:
    """`file:function (lines)` for each function or method under `root` longer than `limit` lines,
    decorators and docstring included."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                lines = (node.end_lineno or node.lineno) - start + 1
                if lines > limit:
                    found.append(f"{path.relative_to(root)}:{node.name} ({lines})")
    return found


def test_no_function_in_train_is_longer_than_the_limit(tmp_path: Path) -> None:
    assert long_functions(SRC / "train", TRAIN_FUNCTION_LINES) == []
    body = "\n".join(f"    x{i} = {i}" for i in range(TRAIN_FUNCTION_LINES))
    (tmp_path / "m.py").write_text(f"def short():\n    return 1\n\n\nasync def long():\n{body}\n", encoding="utf-8")
    assert long_functions(tmp_path, TRAIN_FUNCTION_LINES) == [f"m.py:long ({TRAIN_FUNCTION_LINES + 1})"]


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for rel, text in {"__init__.py": "", **files}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root


def test_the_checks_fail_on_an_upward_import_a_cycle_and_an_unexplained_lazy_import(tmp_path: Path) -> None:
    root = _package(tmp_path, {
        "low/__init__.py": "",
        "low/a.py": "def f():\n    from pkg.high import b\n",  # upward, and lazy without a reason
        "high/__init__.py": "",
        "high/b.py": "import pkg.low.a\nimport pkg.high.c\n",
        "high/c.py": "from pkg.high import b\n",  # b <-> c
        "floor.py": "def g():\n    import json  # lazy: the test says why\n",
    })
    layers = (("floor",), ("low",), ("high",))
    edges = list(import_edges(root, "pkg"))
    up = upward_imports(edges, "pkg", layers)
    assert len(up) == 1 and up[0].startswith("pkg.low.a:2 -> pkg.high.b: imports upward"), up
    assert cycles(edges) == [["pkg.high.b", "pkg.high.c", "pkg.low.a"]]  # a -> b -> a too
    assert unexplained_lazy_imports(root) == ["low/a.py:2: from pkg.high import b"]
    # a name in no layer is reported, and within a layer the listed order holds
    root2 = _package(tmp_path / "two", {"x.py": "import pkg.y\n", "y.py": ""})
    edges2 = list(import_edges(root2, "pkg"))
    assert upward_imports(edges2, "pkg", (("x",),)) == ["pkg.x:1 -> pkg.y: pkg.y is in no layer"]
    assert upward_imports(edges2, "pkg", (("x", "y"),)) != []
    assert upward_imports(edges2, "pkg", (("y", "x"),)) == []


def test_a_type_only_import_is_no_cycle(tmp_path: Path) -> None:
    root = _package(tmp_path, {
        "a.py": "from typing import TYPE_CHECKING\nimport pkg.b\n",
        "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\n",
    })
    assert cycles(list(import_edges(root, "pkg"))) == []


def test_read_layers_refuses_a_design_without_the_block(tmp_path: Path) -> None:
    page = tmp_path / "DESIGN.md"
    page.write_text("# no layers here\n", encoding="utf-8")
    with pytest.raises(ValueError, match="no <!-- layers -->"):
        read_layers(page)
    page.write_text("<!-- layers -->\n1. floor: a, b\n2. c/\n<!-- /layers -->\n", encoding="utf-8")
    assert read_layers(page) == (("a", "b"), ("c",))
