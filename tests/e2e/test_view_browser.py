"""The viewer in a real browser: headless Chromium (Debian `chromium`) driven by Playwright, on a
run that `harnessrl train` makes here (tiny-random, white-box, 2 steps). The static report and
the served page: open, click a rollout, and the trained tokens shown are exactly the training
row's trained ids (rebuilt here with the samples builder); curves are drawn (the run's matplotlib
figure shown at its size, and the SVG charts); a screenshot."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harnessrl.hooks import Hooks

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is absent (Debian package chromium; .ci/run installs it)"),
]


def _harnessrl(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("harnessrl")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=timeout, env=env, check=False)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("view")
    run = tmp / "run"
    sets = ['engine.model="tiny-random"', 'harness.kind="white_box"', "rollout.group_size=4", "sampling.max_tokens=24",
            "train.learning_rate=1e-3", "engine.num_threads=1", "train.num_threads=1",
            'hooks.rollout_reward_fn="harnessrl.recipes.shaping:alternating_smoke_reward"',
            f'sandbox.root_dir="{tmp / "sandboxes"}"']
    done = _harnessrl("train", "--steps", "2", "--out", str(run), *[a for s in sets for a in ("--set", s)])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "template doctor (tiny-random)" in (run / "run.log").read_text()
    return run


def _browser():
    sync_api = pytest.importorskip("playwright.sync_api")
    return sync_api.sync_playwright()


def _expected_rows(run: Path, i: int) -> list[list[int]]:
    from harnessrl.view.detail import build_kwargs, rollout_rows
    from harnessrl.view.index import build_index

    index = build_index(run)
    rows = rollout_rows(index.read(i), index.summaries[i]["advantage"], build_kwargs(index, Hooks()))
    return [[t for t, m in zip(r.input_ids, r.completion_mask) if m] for r in rows]


def _check_page(page, run: Path, shot: Path) -> None:
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.wait_for_selector("tr.rollout")
    # the run's matplotlib curve (curve.png), decoded by the browser at its size
    assert page.eval_on_selector("#curves img#curve-png", "i => [i.complete, i.naturalWidth, i.naturalHeight]") == [True, 800, 450]
    assert page.eval_on_selector("#curves img#curve-png", "i => i.getBoundingClientRect().height") > 100
    assert page.locator("#curves .chart svg polyline").count() >= 3  # reward, pass rate, CLEAN ...
    assert page.locator("#curves .chart[data-metric*='reward/train_mean'] polyline").count() == 1
    assert page.locator("#curves .chart[data-metric*='trained_token_share/turn_1'] polyline").count() == 4
    assert page.locator("tr.rollout").count() == 8
    page.select_option("#f-step", "2")
    assert page.locator("tr.rollout").count() == 4
    page.select_option("#f-step", "")
    row = page.locator("tr.rollout").nth(1)
    i = int(row.get_attribute("data-i"))
    row.click()
    page.wait_for_selector(".row[data-row='0'] .tok.tr")
    expected = _expected_rows(run, i)
    assert expected and all(expected)
    for k, ids in enumerate(expected):
        shown = page.eval_on_selector_all(f".row[data-row='{k}'] .tok.tr", "els => els.map(e => Number(e.dataset.id))")
        assert shown == ids, f"row {k}: trained tokens shown differ from the row's trained ids"
        attr = page.get_attribute(f".row[data-row='{k}']", "data-trained-ids")
        assert [int(x) for x in attr.split(",")] == ids
    from harnessrl.view.index import build_index

    adv = build_index(run).summaries[i]["advantage"]
    sign = "zero" if not adv else ("pos" if adv > 0 else "neg")
    classes = page.get_attribute(".row[data-row='0'] .tok.tr >> nth=0", "class")
    assert classes.split()[:3] == ["tok", "tr", sign], (classes, adv)
    assert set(classes.split()[3:]) <= {"clipped", "bounded"}
    title = page.get_attribute(".row[data-row='0'] .tok.tr >> nth=0", "title")
    assert "logprob" in title
    # the loss's weight on each trained token, from the trainer's token_weights.jsonl
    from harnessrl.loss.token_weights import read_token_weights

    recorded = read_token_weights(run)
    assert recorded, "the trainer recorded no token weights"
    if build_index(run).summaries[i]["rollout_id"] in recorded:
        assert " · weight " in title
        shown_w = page.eval_on_selector_all(".tok.tr[data-w]", "els => els.length")
        assert shown_w == sum(len(ids) for ids in expected)
    assert page.locator(".row[data-row='0'] .mark[data-kind='start']").count() == 1
    # each turn's head says how many of its completion ids train in its row
    heads = page.eval_on_selector_all(".turn .head", "els => els.map(e => e.textContent)")
    assert sum(len(ids) for ids in expected) == sum(int(h.split(" · trained ")[1].split()[0]) for h in heads if " · trained " in h)
    page.locator(".row[data-row='0'] .tok.tr").first.scroll_into_view_if_needed()
    page.screenshot(path=str(shot), full_page=False)
    assert shot.stat().st_size > 10_000
    assert errors == []


def test_static_report_in_chromium(trained_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "report"
    done = _harnessrl("view", str(trained_run), "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "report written to" in done.stdout
    with _browser() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto((out / "index.html").as_uri())
            _check_page(page, trained_run, tmp_path / "report.png")
        finally:
            browser.close()


def test_served_page_in_chromium(trained_run: Path, tmp_path: Path, tokenizer) -> None:
    from harnessrl.view.index import build_index
    from harnessrl.view.server import ViewServer

    server = ViewServer(build_index(trained_run), tokenizer, Hooks(), port=0).start()
    try:
        with _browser() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.goto(server.url)
                _check_page(page, trained_run, tmp_path / "served.png")
            finally:
                browser.close()
    finally:
        server.close()
