"""The viewer's single HTML page: its script and style inlined, the index embedded as JSON.

No external resource is referenced (the page works offline and from `file://`): the run's
curve is the matplotlib figure of `curve.png` inlined as a data URI; the other curves are inline
SVG drawn by the page's own script (`assets/report.js`).
"""

from __future__ import annotations

from importlib import resources
from typing import Any, Literal

import orjson

_HTML = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>harnessrl view</title>
<style>{css}</style></head>
<body data-mode="{mode}">
<header><h1>harnessrl · seen vs trained</h1><div class="facts" id="facts"></div></header>
<main>
<section id="curves"></section>
<section id="list"><h2>Rollouts <span class="muted" id="list-count"></span></h2><div class="filters" id="filters"></div>
<table><thead><tr><th>#</th><th>step</th><th>group</th><th>task</th><th>status</th><th>reward</th><th>adv</th><th>turns</th><th>sampled</th><th>flags</th></tr></thead>
<tbody id="list-body"></tbody></table></section>
<section id="detail"><div class="muted">Click a rollout to see its turns and training rows.</div></section>
</main>
<script type="application/json" id="hrl-index">{index}</script>
<script>{js}</script>
</body></html>
"""


def _asset(name: str) -> str:
    return resources.files("harnessrl.view").joinpath("assets", name).read_text(encoding="utf-8")


def script_safe_json(payload: Any) -> str:
    """`payload` as JSON that cannot end a `<script>` element (`</` written `<\\/`)."""
    return orjson.dumps(payload).decode().replace("</", "<\\/")


def render_page(index_payload: dict[str, Any], mode: Literal["static", "server"]) -> str:
    """The page: `static` loads rollouts from `rollouts/<i>.js`, `server` from
    `api/rollout/<i>.json`."""
    return _HTML.format(css=_asset("report.css"), js=_asset("report.js"), mode=mode,
                        index=script_safe_json(index_payload))
