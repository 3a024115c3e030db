"""Shared fixtures: the tiny random Llama with the real SmolLM2 tokenizer, offline hub, one torch thread."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import re  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

_REQUIRED_PARTS = {
    "HARNESSRL_REQUIRE_BWRAP": re.compile(r"(bwrap|bubblewrap)\b.*(not installed|cannot|absent)|no bwrap", re.I),
    "HARNESSRL_REQUIRE_CHROMIUM": re.compile(r"chromium", re.I),
    "HARNESSRL_REQUIRE_AGENTS": re.compile(r"harness install", re.I),
}
"""A skip whose reason names a missing system part (bubblewrap, Chromium, an agent program) fails
instead when its variable is 1 (`.ci/run` sets them, as it does HARNESSRL_REQUIRE_PODMAN and
HARNESSRL_REQUIRE_VLLM, which their own gates read): in CI a missing install step is a failure."""


def required_part_missing(reason: str, environ=os.environ) -> str | None:
    """The HARNESSRL_REQUIRE_* variable (set to 1 in `environ`) whose part a skip `reason` names."""
    for var, pattern in _REQUIRED_PARTS.items():
        if environ.get(var) == "1" and pattern.search(reason):
            return var
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not report.skipped or getattr(report, "wasxfail", None) is not None:
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    var = required_part_missing(reason)
    if var is not None:
        report.outcome = "failed"
        report.longrepr = f"{var}=1 but the test skipped: {reason}"


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """A cached 2-layer random Llama with the SmolLM2 tokenizer (built once per machine)."""
    from harnessrl.engine.model_store import TINY_MODEL, resolve_model

    return resolve_model(TINY_MODEL)


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir: Path):
    from harnessrl.engine.model_store import load_tokenizer

    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread() -> None:
    """Tests share 2 cores with the engine thread; keep torch to one intra-op thread."""
    try:
        import torch
    except ImportError:  # pragma: no cover
        return
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path):
    """The real embedded engine on the tiny model, one torch thread."""
    from harnessrl.engine.embedded.engine import EmbeddedEngine

    eng = EmbeddedEngine(tiny_model_dir, num_threads=1, max_batch_size=8, seed=0)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def chat(tokenizer, engine):
    from harnessrl.chat.layer import ChatLayer

    return ChatLayer(tokenizer, eos_token_ids=engine.eos_token_ids)


@pytest.fixture
def sandbox_root(tmp_path: Path):
    """A sandbox root that must hold no process and no directory once the test is done."""
    from harnessrl.sandbox.local import leftover_processes, leftover_sandboxes

    root = tmp_path / "sandboxes"
    yield root
    assert leftover_processes(root) == [], "processes left after every sandbox closed"
    assert leftover_sandboxes(root) == [], "sandbox directories left after close()"


_BOTH_LOOPS = ("test_sandbox_",)
"""Test modules (by name prefix) whose async tests run on the default loop and on uvloop:
the sandbox backends spawn processes from the loop, and `train`/`rollout` run on uvloop."""


def pytest_asyncio_loop_factories(config, item):
    """The event loops an async test runs on: `asyncio` (the default loop) for every test, and
    also `uvloop` (when installed) for the sandbox modules named in `_BOTH_LOOPS`.
    `HARNESSRL_TEST_LOOP=uvloop` runs every async test on uvloop only (e.g. an agent's tests)."""
    import asyncio

    if os.environ.get("HARNESSRL_TEST_LOOP") == "uvloop":
        import uvloop

        return {"uvloop": uvloop.new_event_loop}
    factories = {"asyncio": asyncio.new_event_loop}
    if item.path.name.startswith(_BOTH_LOOPS):
        try:
            import uvloop
        except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
            return factories
        factories["uvloop"] = uvloop.new_event_loop
    return factories
