"""The type check on ``src/`` and its ratchet.

mypy runs with the ``[tool.mypy]`` settings of ``pyproject.toml`` and its error count per
file is held to ``tests/typecheck_baseline.json``: a count may fall (the test then asks for
the baseline to be lowered, so the gain is kept), never grow, and a file not in the baseline
must have none. Three escape hatches are counted over all of ``src/`` the same way: the name
``Any`` used in code, ``# type: ignore`` comments and calls of ``getattr``. Counting is done
on tokens, so the words in docstrings and comments do not count.

To lower the baseline after a fix: ``python tests/test_typecheck.py --write``.
"""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import tokenize
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "harnessrl"
BASELINE = Path(__file__).with_name("typecheck_baseline.json")
_ERROR_LINE = re.compile(r"^(?P<path>src/[^:]+\.py):\d+(?::\d+)?: error: ")


def run_mypy() -> tuple[Counter[str], str]:
    """mypy's errors per file (paths relative to the checkout) and its whole output.

    Raises:
        AssertionError: mypy crashed or printed no summary (exit status other than 0 or 1).
    """
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-error-summary", "--no-pretty"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode in (0, 1), f"mypy failed to run (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return count_errors(proc.stdout), proc.stdout


def count_errors(output: str) -> Counter[str]:
    """Errors per file in mypy's output (notes are not errors)."""
    counts: Counter[str] = Counter()
    for line in output.splitlines():
        m = _ERROR_LINE.match(line)
        if m:
            counts[m["path"]] += 1
    return counts


def escape_hatches(source: str) -> Counter[str]:
    """Counts of ``Any`` (a name in code), ``type: ignore`` (comments) and ``getattr(`` calls."""
    counts: Counter[str] = Counter(Any=0, type_ignore=0, getattr=0)
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    for i, tok in enumerate(tokens):
        if tok.type == tokenize.NAME and tok.string == "Any":
            counts["Any"] += 1
        elif tok.type == tokenize.NAME and tok.string == "getattr":
            nxt = tokens[i + 1] if i + 1 < len(tokens) else None
            if nxt is not None and nxt.string == "(":
                counts["getattr"] += 1
        elif tok.type == tokenize.COMMENT and re.search(r"type:\s*ignore", tok.string):
            counts["type_ignore"] += 1
    return counts


def source_hatches() -> dict[str, int]:
    total: Counter[str] = Counter(Any=0, type_ignore=0, getattr=0)
    for path in sorted(SRC.rglob("*.py")):
        total.update(escape_hatches(path.read_text(encoding="utf-8")))
    return dict(total)


def ratchet(baseline: dict[str, int], now: dict[str, int], what: str) -> tuple[list[str], list[str]]:
    """(grown, fallen) messages comparing ``now`` with ``baseline``; a key absent counts 0."""
    grown, fallen = [], []
    for key in sorted(set(baseline) | set(now)):
        was, got = baseline.get(key, 0), now.get(key, 0)
        if got > was:
            grown.append(f"{what} {key}: {got} (baseline {was})")
        elif got < was:
            fallen.append(f"{what} {key}: {got} (baseline {was})")
    return grown, fallen


def _load_baseline() -> dict[str, dict[str, int]]:
    return json.loads(BASELINE.read_text(encoding="utf-8"))


def test_escape_hatches_are_counted_in_code_only():
    src = (
        'from typing import Any  # Any here is a comment\n'
        'def f(x: Any) -> "Any":\n'
        '    """Any in a docstring; getattr( in a docstring."""\n'
        '    y = getattr(x, "a", None)  # type: ignore[attr-defined]\n'
        '    g = getattr\n'
        '    return y  #type:ignore\n'
    )
    assert escape_hatches(src) == Counter(Any=2, type_ignore=2, getattr=1)


def test_error_counting_reads_mypy_lines():
    out = (
        "src/harnessrl/a.py:3: error: Incompatible types  [assignment]\n"
        "src/harnessrl/a.py:9:5: error: Missing return  [return]\n"
        "src/harnessrl/a.py:9: note: See https://mypy.rtfd.io\n"
        "src/harnessrl/b/c.py:1: error: Name \"x\" is not defined  [name-defined]\n"
    )
    assert count_errors(out) == Counter({"src/harnessrl/a.py": 2, "src/harnessrl/b/c.py": 1})


def test_ratchet_fails_on_growth_and_asks_to_lower_on_a_fall():
    grown, fallen = ratchet({"a.py": 2, "b.py": 1}, {"a.py": 3, "c.py": 1}, "errors")
    assert grown == ["errors a.py: 3 (baseline 2)", "errors c.py: 1 (baseline 0)"]
    assert fallen == ["errors b.py: 0 (baseline 1)"]


def test_escape_hatches_do_not_grow():
    grown, fallen = ratchet(_load_baseline()["escape_hatches"], source_hatches(), "count of")
    assert not grown, "more escape hatches in src/ than the baseline allows:\n" + "\n".join(grown)
    assert not fallen, ("fewer escape hatches than the baseline; lower it with "
                        "`python tests/test_typecheck.py --write`:\n" + "\n".join(fallen))


def test_mypy_errors_do_not_grow():
    pytest.importorskip("mypy", reason="mypy comes with the [test] extras (make setup)")
    counts, output = run_mypy()
    grown, fallen = ratchet(_load_baseline()["mypy_errors"], dict(counts), "mypy errors in")
    baseline = _load_baseline()["mypy_errors"]
    grown_files = {f for f, n in counts.items() if n > baseline.get(f, 0)}
    new_lines = "\n".join(line for line in output.splitlines()
                          if line.split(":", 1)[0] in grown_files)
    assert not grown, ("mypy finds more errors than the baseline allows:\n" + "\n".join(grown)
                       + "\n\n" + new_lines)
    assert not fallen, ("mypy finds fewer errors than the baseline; lower it with "
                        "`python tests/test_typecheck.py --write`:\n" + "\n".join(fallen))


def test_the_projects_own_warnings_are_errors():
    """``filterwarnings`` in pyproject: a warning whose module is harnessrl or below fails."""
    import warnings
    with pytest.raises(DeprecationWarning):
        warnings.warn_explicit("old call", DeprecationWarning, "loop.py", 1, module="harnessrl.train.loop")
    ours = [f for f in warnings.filters if f[0] == "error" and f[3] is not None
            and f[3].match("harnessrl.train.loop")]
    assert ours, "no error filter for harnessrl's modules is in effect"
    assert not any(f[3].match("harnessrlx") or f[3].match("torch.nn") for f in ours)

if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/test_typecheck.py --write")
    errors, _ = run_mypy()
    BASELINE.write_text(json.dumps(
        {"mypy_errors": dict(sorted(errors.items())), "escape_hatches": source_hatches()},
        indent=2) + "\n", encoding="utf-8")
    print(f"wrote {BASELINE}: {sum(errors.values())} mypy errors in {len(errors)} files, "
          f"{source_hatches()}")
