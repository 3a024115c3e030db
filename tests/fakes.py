"""Small fakes and helpers for unit tests: `FakeEngine` returns canned completion ids and
logprobs; `in_process` serves the proxy app over an in-process transport.

It keeps the Engine protocol (`engine/base.py`): the `Completion.prompt_ids` it returns are
exactly its input, it records every call, and it can be told to fail.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from harnessrl.errors import ContextLengthError, EngineError
from harnessrl.proxy.app import ProxyDeps, make_app
from harnessrl.proxy.capture import CaptureDeps
from harnessrl.proxy.config import ProxyConfig
from harnessrl.proxy.server import native_protocols
from harnessrl.proxy.sessions import SessionStore
from harnessrl.types import Completion, Sampling

CAPTURES_DIR = Path(__file__).parent / "data" / "captures"
"""Request bodies captured from real agents (opencode, pi, mini-swe-agent, aider, codex)."""


@dataclass
class FakeEngine:
    """Answers every call with `completion_ids` (cut to `sampling.max_tokens`).

    `completion_ids` may be a callable of the call number (0-based) for per-call answers.
    Logprobs are `logprob` for every id; `finish_reason` is `length` when the cut happened.
    """

    completion_ids: Sequence[int] | Callable[[int], Sequence[int]] = (42, 2)
    logprob: float = -0.5
    max_context_tokens: int = 8192
    eos_token_ids: tuple[int, ...] = (2,)
    policy_version: int = 0
    fail_with: Exception | None = None
    delay_s: float = 0.0
    """Seconds each call takes (asyncio.sleep), to hold calls in flight."""
    calls: list[tuple[list[int], Sampling]] = field(default_factory=list)

    async def generate(self, prompt_ids: list[int], sampling: Sampling) -> Completion:
        self.calls.append((list(prompt_ids), sampling))
        if self.delay_s > 0:
            await asyncio.sleep(self.delay_s)
        if self.fail_with is not None:
            raise self.fail_with
        if len(prompt_ids) + 1 > self.max_context_tokens:
            raise ContextLengthError(f"prompt of {len(prompt_ids)} ids exceeds {self.max_context_tokens}")
        ids = self.completion_ids(len(self.calls) - 1) if callable(self.completion_ids) else self.completion_ids
        ids = list(ids)
        finish = "length" if len(ids) > sampling.max_tokens else "stop"
        ids = ids[: sampling.max_tokens]
        return Completion(prompt_ids=tuple(prompt_ids), completion_ids=tuple(ids),
                          completion_logprobs=tuple(self.logprob for _ in ids),
                          finish_reason=finish, policy_version=self.policy_version)

    def load_weights(self, state_dict: dict, version: int) -> None:
        self.policy_version = version

    def close(self) -> None:
        return None


def broken_engine() -> FakeEngine:
    return FakeEngine(fail_with=EngineError("engine stopped"))


def in_process(engine: object, chat: object, **config: object) -> tuple[httpx.AsyncClient, SessionStore]:
    """An httpx client on the proxy app (every protocol route) in-process, and its session store."""
    store = SessionStore()
    deps = ProxyDeps(CaptureDeps(engine, chat, ProxyConfig(**config)), store)  # type: ignore[arg-type]
    app = make_app(deps, native_protocols())
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1"), store
