"""Shared fixtures: the tiny random Llama with the real SmolLM2 tokenizer, offline hub, one torch thread."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


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
    from harnessrl.engine.embedded import EmbeddedEngine

    eng = EmbeddedEngine(tiny_model_dir, num_threads=1, max_batch_size=8, seed=0)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def chat(tokenizer, engine):
    from harnessrl.engine.chat import ChatLayer

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
