"""The README and docs/ stay usable: every relative link resolves (file and heading), and the
README's set-up commands are what the Makefile runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def _links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return [m.group(1) for m in LINK.finditer(text)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_resolves(page: Path) -> None:
    bad = []
    for target in _links(page):
        if re.match(r"[a-z]+:", target):
            continue  # an absolute URL
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert not bad, f"{page.name}: " + "; ".join(bad)


def test_the_readme_set_up_commands_are_the_makefiles() -> None:
    readme = (REPO / "README.md").read_text()
    makefile = (REPO / "Makefile").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, re.S)
    assert blocks[:2] == ["make train\n", "make test\n"]
    for target in ("train", "test"):
        assert re.search(rf"^{target}:", makefile, re.M), f"Makefile has no target {target}"
    # the run `make train` makes, as the README spells it out
    spelled = re.sub(r"\s*\\\n\s*", " ", blocks[2]).split()
    defaults = dict(re.findall(r"^(\w+) \?= (.*)$", makefile, re.M))
    recipe = f"--steps {defaults['STEPS']} --out {defaults['OUT']} {defaults['RECIPE']} {defaults['EVAL']}"
    recipe = recipe.replace("$(STEPS)", defaults["STEPS"])
    assert spelled == [".venv/bin/harnessrl", "train", *recipe.split()]
    assert "$(VENV)/bin/harnessrl train --steps $(STEPS) --out $(OUT) $(RECIPE) $(EVAL)" in makefile
    assert "HF_HUB_OFFLINE=1 $(PY) -m pytest -q" in makefile
    assert "`HF_HUB_OFFLINE=1 .venv/bin/python -m pytest -q`" in readme
    assert defaults["VENV"] == ".venv"


def test_the_readme_is_a_quick_start() -> None:
    assert len((REPO / "README.md").read_text().splitlines()) <= 200
