"""Small fakes and helpers for unit tests: `FakeEngine` returns canned completion ids and
logprobs; `in_process` serves the proxy app over an in-process transport; `FakeSandbox` is the
Sandbox seam in memory (files in a dict, scripted process handles, agent paths that are not
host paths, as in a container), with `FakeBackend` creating them.

It keeps the Engine protocol (`engine/base.py`): the `Completion.prompt_ids` it returns are
exactly its input, it records every call, and it can be told to fail.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from harnessrl.errors import ContextLengthError, EngineError, SandboxError
from harnessrl.proxy.app import ProxyDeps, make_app
from harnessrl.proxy.capture import CaptureDeps
from harnessrl.proxy.config import ProxyConfig
from harnessrl.proxy.server import native_protocols
from harnessrl.proxy.sessions import SessionStore
from harnessrl.sandbox.base import BASES, READ_MAX_BYTES, Base, ExecResult
from harnessrl.rewards.base import Reward
from harnessrl.types import Completion, Endpoint, Row, Sampling, Trace

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

    async def generate(self, prompt_ids: list[int], sampling: Sampling, *, affinity: str | None = None,
                       cache_scope: str | None = None) -> Completion:
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

    def stats(self) -> None:
        return None

    def forget(self, affinity: str) -> None:
        return None

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


@dataclass
class ScriptedProcess:
    """A `SandboxProcess` whose life is scripted: it exits with `exit_code` after `run_s`
    seconds, or (`exit_code=None`) runs until `kill_tree`; `kill_survives` makes the kill
    raise as `LocalProcess` does when a pid survives SIGKILL."""

    exit_code: int | None = 0
    run_s: float = 0.0
    kill_survives: bool = False
    pid: int = 4242
    returncode: int | None = None
    kills: int = 0

    async def wait(self, timeout_s: float | None = None) -> int | None:
        if self.returncode is not None:
            return self.returncode
        if self.exit_code is None or (timeout_s is not None and self.run_s > timeout_s):
            await asyncio.sleep(timeout_s if timeout_s is not None else 3600.0)
            return None
        await asyncio.sleep(self.run_s)
        self.returncode = self.exit_code
        return self.returncode

    async def kill_tree(self) -> int:
        self.kills += 1
        if self.kill_survives:
            raise SandboxError(f"pids [{self.pid}] of spawned {self.pid} survived SIGKILL")
        if self.returncode is not None:
            return 0
        self.returncode = -15
        return 1


Agent = Callable[["FakeSandbox", list[str], dict[str, str]], ScriptedProcess]
"""What a spawn does in a `FakeSandbox`: may write files (`sandbox.files`), returns the handle."""


class FakeSandbox:
    """The Sandbox seam in memory.

    Files live in `files[(base, rel_path)]` (bytes) with their modes in `modes`; a key in
    `links` reads and writes as a planted symlink does (SandboxError). `agent_path` gives
    `/sandbox/<base>/<rel>`, which is no host path (as in a container). `spawn` records
    `(argv, env, log_file)` in `spawned` and runs `agent`; `kill_fails` makes
    `kill_processes` raise; `proxy_host` is the host `agent_endpoint` puts in place of
    127.0.0.1 (a container's route to the host). Every method call is appended to `calls`.
    """

    def __init__(self, root: Path = Path("/nonexistent/fake-sandbox"), *, agent: Agent | None = None,
                 kill_fails: bool = False, proxy_host: str | None = None) -> None:
        self.root = root
        self.proxy_host = proxy_host
        self.agent = agent or (lambda sandbox, argv, env: ScriptedProcess())
        self.kill_fails = kill_fails
        self.files: dict[tuple[Base, str], bytes] = {}
        self.modes: dict[tuple[Base, str], int] = {}
        self.links: set[tuple[Base, str]] = set()
        self.spawned: list[tuple[list[str], dict[str, str], str | None]] = []
        self.processes: list[ScriptedProcess] = []
        self.calls: list[str] = []

    @property
    def workdir(self) -> Path:
        return self.root / "work"

    @property
    def home(self) -> Path:
        return self.root / "home"

    @staticmethod
    def _key(base: Base, rel_path: str) -> tuple[Base, str]:
        if base not in BASES or rel_path.startswith("/") or ".." in rel_path.split("/"):
            raise SandboxError(f"fake sandbox: {base}/{rel_path!r} escapes the sandbox")
        return base, rel_path

    def agent_path(self, base: Base, rel_path: str = "") -> str:
        self._key(base, rel_path)
        return f"/sandbox/{base}/{rel_path}" if rel_path else f"/sandbox/{base}"

    def agent_endpoint(self, endpoint: Endpoint) -> Endpoint:
        if self.proxy_host is None:
            return endpoint
        return dataclasses.replace(
            endpoint, base_url=endpoint.base_url.replace("127.0.0.1", self.proxy_host),
            keyed_base_url=endpoint.keyed_base_url.replace("127.0.0.1", self.proxy_host))

    async def exec(self, cmd, timeout_s, env=None, cwd=None) -> ExecResult:  # noqa: ANN001
        self.calls.append("exec")
        return ExecResult(0, "", "", False, 0.0)

    async def spawn(self, argv: list[str], env: dict[str, str] | None = None,
                    log_file: str | None = None) -> ScriptedProcess:
        self.calls.append("spawn")
        self.spawned.append((list(argv), dict(env or {}), log_file))
        proc = self.agent(self, list(argv), dict(env or {}))
        self.processes.append(proc)
        return proc

    def read_file(self, rel_path: str, *, base: Base = "work", max_bytes: int = READ_MAX_BYTES,
                  tail: bool = False) -> bytes:
        key = self._key(base, rel_path)
        if key in self.links:
            raise SandboxError(f"fake sandbox: {rel_path!r} not read: a symlink (not followed)")
        if key not in self.files:
            raise FileNotFoundError(rel_path)
        data = self.files[key]
        return data[-max_bytes:] if tail and max_bytes else data[:max_bytes]

    def write_file(self, rel_path: str, data: str | bytes, *, base: Base = "work", mode: int = 0o644) -> None:
        self.calls.append("write_file")
        key = self._key(base, rel_path)
        if key in self.links:
            raise SandboxError(f"fake sandbox: {rel_path!r} not written: a symlink (not followed)")
        self.files[key] = data.encode() if isinstance(data, str) else data
        self.modes[key] = mode

    def text(self, base: Base, rel_path: str) -> str:
        """A file's text (test helper)."""
        return self.files[(base, rel_path)].decode()

    async def kill_processes(self) -> int:
        self.calls.append("kill_processes")
        if self.kill_fails:
            raise SandboxError("sandbox fake: pids [4242] survived SIGKILL")
        return 1

    async def close(self) -> None:
        self.calls.append("close")
        if self.kill_fails:
            raise SandboxError("sandbox fake: pids [4242] survived SIGKILL")


class FakeBackend:
    """Creates `FakeSandbox`es; `kill_fails[i]` for the i-th one; keeps them in `made`."""

    def __init__(self, root: Path, kill_fails: Sequence[bool] = (), agent: Agent | None = None,
                 proxy_host: str | None = None) -> None:
        self.root, self.kill_fails, self.agent, self.proxy_host = root, list(kill_fails), agent, proxy_host
        self.made: list[FakeSandbox] = []

    async def create(self, rollout_id: str, workspace: dict[str, str]) -> FakeSandbox:
        sandbox = FakeSandbox(self.root / rollout_id, agent=self.agent, proxy_host=self.proxy_host,
                              kill_fails=self.kill_fails.pop(0) if self.kill_fails else False)
        for rel_path, text in workspace.items():
            sandbox.write_file(rel_path, text)
        sandbox.calls.clear()
        self.made.append(sandbox)
        return sandbox


def opposed_rows() -> list[Row]:
    """Two 40-token training rows (30 context, 10 trained ids at sampler logprob -2.0, policy
    version 0) with opposite advantages (+1, -1): a small step that moves the weights."""
    ids = tuple(range(100, 140))
    mask = tuple([0] * 30 + [1] * 10)
    lps = tuple([0.0] * 30 + [-2.0] * 10)
    vers = tuple([-1] * 30 + [0] * 10)
    return [Row(ids, mask, lps, vers, "r0", 0, 1.0), Row(ids[::-1], mask, lps, vers, "r1", 0, -1.0)]


class ScriptedVerifier:
    """A verifier that counts its calls, raises when `fails`, and otherwise scores 1.0 when the
    final answer equals `expected` (0.0 when `expected` is None)."""

    def __init__(self, fails: bool, expected: str | None = None) -> None:
        self.fails, self.expected, self.scored = fails, expected, 0

    async def score(self, task: object, sandbox: object, final_answer: str | None) -> Reward:
        self.scored += 1
        if self.fails:
            raise RuntimeError("verifier bug")
        return Reward(value=float(self.expected is not None and final_answer == self.expected))


class FakeSessions:
    """The runner's session host without a proxy, for agents that never call a model: a rollout's
    session id is its rollout id, its key "k", its endpoint a closed loopback port; `open` holds
    the sessions not yet closed."""

    def __init__(self) -> None:
        self.open: set[str] = set()

    def open_session(self, rollout_id: str, group: str | None = None) -> tuple[str, str]:
        self.open.add(rollout_id)
        return rollout_id, "k"

    def endpoint(self, key: str) -> Endpoint:
        return Endpoint(base_url="http://127.0.0.1:9/v1", api_key=key, model="m")

    def close_session(self, session_id: str) -> Trace:
        self.open.discard(session_id)
        return Trace(session_id=session_id, rollout_id=session_id)
