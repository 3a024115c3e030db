"""Rollouts on a Ray cluster (`rollout.executor = "ray"`): sandboxes, CLI agents and verifiers
run on the cluster's nodes; the proxy, the engine and the orchestrator stay in this process.

Responsibility: give the rollout runner (`rollout/runner.py`) three seams whose work happens on
a node: a `SandboxBackend` whose sandboxes live on a node (`RaySandbox`), a harness that runs a
CLI agent's whole `Harness.run` on that node (`NodeHarness`), and a verifier that scores there
(`NodeVerifier`). The runner, the orchestrator (groups, staleness tickets, cancellation) and the
one-status-per-rollout rule are unchanged: the session is opened, revoked and its trace read
here, between the node's agent phase and its verification.

One worker actor per live node (per node offering `rollout.ray.node_resource` when it is set;
`NodeWorker`, pinned with a hard node-affinity strategy, asking for no CPU) owns that node's
sandboxes: the run's sandbox backend (`sandbox.kind`), whose sandboxes reach
the proxy through a node-local Unix socket (`sandbox/tcp_relay.py`) relayed over TCP to the
proxy's agents listener at `advertise_host:port`; the admin listener is never reachable from a
node. Without bubblewrap an agent dials `advertise_host:port` itself. The white-box harness
samples the engine in this process, so it runs here and only its tools (`exec`, `write_file`)
and the verifier run on the node.

Placement (the live node with the fewest sandboxes, `max_sandboxes_per_node`) and the calls to
a node's worker, which turn a dead or silent node into `SandboxLostError` (the runner records
`infra_error`; the run goes on with the other nodes): `rollout/ray_nodes.py`. A node starts at
most `sandbox_starts_per_s` sandboxes per second. The node id is recorded on the rollout
(`Rollout.metadata["node_id"]`).

What it does not do: start a cluster (join it with `rollout.ray.address`, or "local"), install
agents on nodes (each node needs harnessrl and `harnessrl harness install` as on this host), or
restart a dead node's worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, Literal, TypeVar, cast
from urllib.parse import urlsplit, urlunsplit

from pydantic import TypeAdapter

from harnessrl.config import SandboxConfig
from harnessrl.errors import ConfigError, SandboxError, SandboxLostError
from harnessrl.harness.base import Harness, HarnessResult
from harnessrl.harness.install import installed_agent_dirs
from harnessrl.harness.options import canonical_kind
from harnessrl.harness.select import make_harness
from harnessrl.rewards.base import Reward, Verifier, remaining_budget_s, verify_budget
from harnessrl.rollout.ray_nodes import SYNC_CALL_TIMEOUT_S, RayNode, RayNodes
from harnessrl.sandbox.base import READ_MAX_BYTES, Base, ExecResult, SandboxProcess
from harnessrl.sandbox.select import make_backend
from harnessrl.sandbox.tcp_relay import TcpRelay
from harnessrl.tasks.base import Task
from harnessrl.types import Endpoint

__all__ = ["SHUTDOWN_TIMEOUT_S", "SYNC_CALL_TIMEOUT_S", "NodeHarness", "NodeVerifier", "NodeWorker", "RayNode",
           "RayNodes", "RayRollouts", "RaySandbox", "RaySandboxBackend", "advertise_host", "start_ray_rollouts"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_SANDBOX_CALLS = frozenset({"exec", "agent_path", "agent_endpoint", "read_file", "write_file", "kill_processes"})
SHUTDOWN_TIMEOUT_S = 30.0
"""How long the end of a run waits for a node to close its sandboxes."""
RAYLET_POLL_S = 0.2
"""How often a node's worker checks that its raylet (its parent process) is alive."""


class NodeWorker:
    """The rollout worker on one node (a Ray actor, see the module docstring).

    Args:
        sandbox_config: the run's `[sandbox]` as a dict (any `sandbox.kind`; the node's
            sandboxes use it as is).
        harness_kind, harness_options: the run's harness; a CLI harness is built and run on the
            node, the white-box one never is.
        proxy_host, proxy_port: the agents listener as this node reaches it.
        sandbox_starts_per_s: most sandbox creations per second (0: no limit).
    """

    def __init__(self, sandbox_config: dict[str, Any], harness_kind: str, harness_options: dict[str, Any],
                 proxy_host: str, proxy_port: int, sandbox_starts_per_s: float) -> None:
        self._config = TypeAdapter(SandboxConfig).validate_python(sandbox_config)
        self._harness_kind = harness_kind
        self._harness_options = harness_options
        self._proxy = (proxy_host, proxy_port)
        self._interval = 1.0 / sandbox_starts_per_s if sandbox_starts_per_s > 0 else 0.0
        self._next_start = 0.0
        self._sandboxes: dict[str, Any] = {}
        self._agents: dict[str, asyncio.Task[Any]] = {}
        self._backend: Any = None
        self._harness: Harness | None = None
        self._relay: Any = None
        self._raylet_pid = os.getppid()
        """The raylet that started this worker: when it dies, so does the node (`_watch_raylet`)."""
        self._watch: asyncio.Task[None] | None = None
        self._lost: str | None = None
        """Why this node is lost (its raylet died), once it is: every call then raises it."""

    async def ready(self, isolation: Literal["required", "best_effort"], concurrency: int = 1) -> dict[str, Any]:
        """Start the relay and the sandbox backend and apply the isolation policy for
        `concurrency` sandboxes at once on this node; returns `{"node_id", "pid", "gaps"}`.
        Raises SandboxError (the backend's) under "required" when this node's sandboxes would
        not isolate, and in either mode when `concurrency` of them could take more than this
        node's file table allows (`sandbox/filetable.py`)."""
        if self._backend is None:
            import ray  # lazy: ray, heavy; not needed at import

            self._relay = await TcpRelay.start(*self._proxy)
            self._backend = make_backend(self._config, ro_binds=installed_agent_dirs(),
                                         proxy_port=self._proxy[1], proxy_socket=self._relay.socket_path)
            if canonical_kind(self._harness_kind) != "white_box":
                self._harness = make_harness(self._harness_kind, dict(self._harness_options))
            self._node_id = ray.get_runtime_context().get_node_id()
            if self._raylet_pid > 1:
                self._watch = asyncio.ensure_future(self._watch_raylet())
        gaps = self._backend.check_isolation(isolation, concurrency)
        return {"node_id": self._node_id, "pid": os.getpid(), "gaps": gaps}

    async def _watch_raylet(self) -> None:
        """Every `RAYLET_POLL_S`, check that the raylet is still this process's parent. Once it
        died, the node is lost: every call still running or arriving here raises
        `SandboxLostError` (the driver ends those rollouts as `infra_error`), every sandbox is
        closed (processes killed, directories removed) and the worker exits.

        Left to Ray, a worker whose raylet died goes on answering the driver's calls (they do
        not pass through the raylet) until its own next call to the raylet fails, about a
        second later, and is then ended without closing anything: a podman container (not a
        child of the worker) and the sandbox directories would outlive the node, and a
        bubblewrap sandbox only its `--die-with-parent`."""
        while os.getppid() == self._raylet_pid:
            await asyncio.sleep(RAYLET_POLL_S)
        self._lost = f"Ray node {self._node_id} died: its raylet (pid {self._raylet_pid}) is gone"
        log.error("%s; closing the node's %d sandboxes and exiting", self._lost, len(self._sandboxes))
        try:
            await asyncio.wait_for(self.shutdown(), SHUTDOWN_TIMEOUT_S)
        finally:
            os._exit(1)

    async def _while_alive(self, work: Awaitable[T]) -> T:
        """`await work`, raising `SandboxLostError` instead of its result or error (its
        cancellation included) when the node was lost meanwhile."""
        try:
            result = await work
        except BaseException:
            if self._lost is not None:
                raise SandboxLostError(self._lost) from None
            raise
        if self._lost is not None:
            raise SandboxLostError(self._lost)
        return result

    async def create(self, rollout_id: str, workspace: dict[str, str]) -> dict[str, str]:
        """A new sandbox (after the start-rate wait); returns `{"sandbox_id", "workdir", "home"}`."""
        return await self._while_alive(self._create(rollout_id, workspace))

    async def _create(self, rollout_id: str, workspace: dict[str, str]) -> dict[str, str]:
        if self._interval:
            now = time.monotonic()
            at = max(now, self._next_start)
            self._next_start = at + self._interval
            if at > now:
                await asyncio.sleep(at - now)
        sandbox = await self._backend.create(rollout_id, workspace)
        self._sandboxes[sandbox.sandbox_id] = sandbox
        return {"sandbox_id": sandbox.sandbox_id, "workdir": str(sandbox.workdir), "home": str(sandbox.home)}

    def _sandbox(self, sandbox_id: str) -> Any:
        if self._lost is not None:
            raise SandboxLostError(self._lost)
        try:
            return self._sandboxes[sandbox_id]
        except KeyError:
            raise SandboxError(f"sandbox {sandbox_id!r} is not open on this node") from None

    async def call(self, sandbox_id: str, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """`sandbox.method(*args, **kwargs)` (awaited when it is a coroutine)."""
        if method not in _SANDBOX_CALLS:
            raise SandboxError(f"sandbox method {method!r} is not callable on a node")

        async def run() -> Any:
            result = getattr(self._sandbox(sandbox_id), method)(*args, **kwargs)
            return await result if asyncio.iscoroutine(result) else result

        return await self._while_alive(run())

    async def run_harness(self, sandbox_id: str, task: Task, endpoint: Endpoint, timeout_s: float) -> HarnessResult:
        """The run's CLI harness on `task` in the sandbox (the agent runs on this node)."""
        if self._harness is None:
            raise ConfigError(f"harness.kind={self._harness_kind!r} does not run on a node")
        sandbox = self._sandbox(sandbox_id)
        current = asyncio.current_task()
        assert current is not None
        self._agents[sandbox_id] = current
        try:
            return await self._while_alive(self._harness.run(task, sandbox, endpoint, timeout_s))
        finally:
            self._agents.pop(sandbox_id, None)

    async def verify(self, sandbox_id: str, verifier: Verifier, task: Task, final_answer: str | None,
                     budget_s: float | None = None) -> Reward:
        """`verifier.score` here; `budget_s`: what is left of the driver's verify budget
        (`rewards/base.verify_budget`), set again on this node (monotonic clocks differ)."""
        score = verifier.score(task, self._sandbox(sandbox_id), final_answer)
        if budget_s is None:
            return await self._while_alive(score)
        with verify_budget(budget_s):
            return await self._while_alive(score)

    async def close(self, sandbox_id: str) -> None:
        """Stop the sandbox's agent (if its harness still runs) and close the sandbox; idempotent."""
        agent = self._agents.pop(sandbox_id, None)
        if agent is not None:
            agent.cancel()
            await asyncio.gather(agent, return_exceptions=True)
        sandbox = self._sandboxes.pop(sandbox_id, None)
        if sandbox is not None:
            await sandbox.close()

    async def shutdown(self) -> int:
        """Close every sandbox still open and the relay; returns how many sandboxes were open."""
        open_ids = list(self._sandboxes)
        await asyncio.gather(*(self.close(sid) for sid in open_ids), return_exceptions=True)
        if self._relay is not None:
            await self._relay.aclose()
            self._relay = None
        return len(open_ids)


class RaySandbox:
    """A sandbox on a Ray node: every method runs on the node's worker. `workdir` and `home`
    are paths on that node. `spawn` is refused here: a CLI agent is spawned by its harness,
    which runs on the node (`NodeHarness`)."""

    def __init__(self, nodes: RayNodes, node: RayNode, info: dict[str, str], advertise_host: str) -> None:
        self._nodes = nodes
        self._node = node
        self.sandbox_id = info["sandbox_id"]
        self._workdir = Path(info["workdir"])
        self._home = Path(info["home"])
        self._advertise_host = advertise_host
        self._closed = False

    @property
    def node_id(self) -> str:
        """Ray id of the node this sandbox lives on."""
        return self._node.node_id

    @property
    def workdir(self) -> Path:
        return self._workdir

    @property
    def home(self) -> Path:
        return self._home

    def _check_alive(self) -> None:
        if not self._node.alive:
            raise SandboxLostError(f"Ray node {self._node.node_id} of sandbox {self.sandbox_id} is lost")

    def _sync(self, method: str, *args: Any, **kwargs: Any) -> Any:
        self._check_alive()
        return self._nodes.call_sync(self._node, self._node.worker.call.remote(self.sandbox_id, method, args, kwargs))

    async def _async(self, timeout_s: float, method: str, *args: Any, **kwargs: Any) -> Any:
        self._check_alive()
        ref = self._node.worker.call.remote(self.sandbox_id, method, args, kwargs)
        return await self._nodes.call(self._node, ref, timeout_s)

    def agent_path(self, base: Base, rel_path: str = "") -> str:
        return self._sync("agent_path", base, rel_path)

    def agent_endpoint(self, endpoint: Endpoint) -> Endpoint:
        """`endpoint` with its host replaced by the address nodes dial, then as the node's
        sandbox addresses it (`127.0.0.1:<port>` under bubblewrap)."""
        keyed = _with_host(endpoint.keyed_base_url, self._advertise_host) if endpoint.keyed_base_url else ""
        remote = dataclasses.replace(endpoint, base_url=_with_host(endpoint.base_url, self._advertise_host),
                                     keyed_base_url=keyed)
        return self._sync("agent_endpoint", remote)

    async def exec(self, cmd: str | list[str], timeout_s: float, env: dict[str, str] | None = None,
                   cwd: Path | None = None) -> ExecResult:
        return await self._async(timeout_s, "exec", cmd, timeout_s, env=env, cwd=cwd)

    async def spawn(self, argv: list[str], env: dict[str, str] | None = None,
                    log_file: str | None = None) -> SandboxProcess:
        raise SandboxError(f"sandbox {self.sandbox_id} lives on Ray node {self.node_id}: processes are "
                           "spawned there by the node's harness, not from the driver")

    def read_file(self, rel_path: str, *, base: Base = "work", max_bytes: int = READ_MAX_BYTES,
                  tail: bool = False) -> bytes:
        return self._sync("read_file", rel_path, base=base, max_bytes=max_bytes, tail=tail)

    def write_file(self, rel_path: str, data: str | bytes, *, base: Base = "work", mode: int = 0o644) -> None:
        self._sync("write_file", rel_path, data, base=base, mode=mode)

    async def kill_processes(self) -> int:
        return await self._async(0.0, "kill_processes")

    async def run_harness(self, task: Task, endpoint: Endpoint, timeout_s: float) -> HarnessResult:
        self._check_alive()
        ref = self._node.worker.run_harness.remote(self.sandbox_id, task, endpoint, timeout_s)
        return await self._nodes.call(self._node, ref, timeout_s)

    async def verify(self, verifier: Verifier, task: Task, final_answer: str | None) -> Reward:
        self._check_alive()
        ref = self._node.worker.verify.remote(self.sandbox_id, verifier, task, final_answer, remaining_budget_s())
        return await self._nodes.call(self._node, ref, 0.0)  # the runner bounds it by verify_timeout_s

    async def close(self) -> None:
        """Close the sandbox on its node (a dead node's sandboxes died with it); frees its slot."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._node.alive:
                ref = self._node.worker.close.remote(self.sandbox_id)
                with contextlib.suppress(SandboxLostError):
                    await self._nodes.call(self._node, ref, 0.0)
        finally:
            await self._nodes.release(self._node)


class RaySandboxBackend:
    """Creates `RaySandbox`es on the least-loaded live node (see the module docstring)."""

    def __init__(self, nodes: RayNodes, advertise_host: str) -> None:
        self.nodes = nodes
        self.advertise_host = advertise_host

    async def create(self, rollout_id: str, workspace: dict[str, str]) -> RaySandbox:
        """Raises SandboxLostError when no node is alive or the chosen one dies meanwhile, the
        node's SandboxError when it cannot create the sandbox."""
        node = await self.nodes.acquire()
        try:
            info = await self.nodes.call(node, node.worker.create.remote(rollout_id, workspace), 0.0)
        except BaseException:
            await self.nodes.release(node)
            raise
        return RaySandbox(self.nodes, node, info, self.advertise_host)


class NodeHarness:
    """A CLI harness whose `run` happens on the sandbox's node (the node builds the same
    harness from the run's config)."""

    def __init__(self, name: str) -> None:
        self.name = name

    async def run(self, task: Task, sandbox: Any, endpoint: Endpoint, timeout_s: float) -> HarnessResult:
        if not isinstance(sandbox, RaySandbox):
            raise SandboxError(f"NodeHarness runs in Ray sandboxes only, got {type(sandbox).__name__}")
        return await sandbox.run_harness(task, endpoint, timeout_s)


class NodeVerifier:
    """Scores on the sandbox's node with `inner` (pickled there; a config-named verifier's module
    must be importable on every node)."""

    def __init__(self, inner: Verifier) -> None:
        self.inner = inner

    async def score(self, task: Task, sandbox: Any, final_answer: str | None) -> Reward:
        if not isinstance(sandbox, RaySandbox):
            raise SandboxError(f"NodeVerifier scores Ray sandboxes only, got {type(sandbox).__name__}")
        return await sandbox.verify(self.inner, task, final_answer)


@dataclasses.dataclass
class RayRollouts:
    """What `start_ray_rollouts` yields: the seams the runner uses, and the nodes."""

    harness: Harness
    backend: RaySandboxBackend
    verifier_for: Callable[[Task], Verifier]
    nodes: RayNodes


def _with_host(url: str, host: str) -> str:
    parts = urlsplit(url)
    port = f":{parts.port}" if parts.port is not None else ""
    shown = f"[{host}]" if ":" in host else host
    return urlunsplit((parts.scheme, f"{shown}{port}", parts.path, parts.query, parts.fragment))


def advertise_host(proxy_host: str, configured: str | None) -> str:
    """The address nodes dial: `configured`, else `proxy_host` unless it is a wildcard, else
    this node's Ray address."""
    if configured:
        return configured
    if proxy_host not in ("0.0.0.0", "::", ""):
        return proxy_host
    import ray  # lazy: ray, heavy; not needed at import

    return ray.util.get_node_ip_address()


def _init_ray(address: str, local_num_cpus: int) -> bool:
    """Join (or, for "local", start) Ray unless this process already did; True when it did."""
    import ray  # lazy: ray, heavy; not needed at import

    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if address == "local":
        ray.init(num_cpus=local_num_cpus, object_store_memory=128 << 20, include_dashboard=False,
                 log_to_driver=False, logging_level=logging.WARNING, namespace="harnessrl")
    else:
        ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING, namespace="harnessrl")
    return True


@contextlib.asynccontextmanager
async def start_ray_rollouts(cfg: Any, proxy_port: int, harness: Harness, verifier_for: Callable[[Task], Verifier],
                             isolation: Literal["required", "best_effort"]) -> AsyncIterator[RayRollouts]:
    """Join the cluster, start one `NodeWorker` per live node and yield the node-side seams;
    on exit close every node's sandboxes, stop the workers and leave Ray (if joined here).

    Args:
        cfg: the `RunConfig` (`rollout.ray`, `sandbox`, `harness`, `tasks` are read).
        proxy_port: the agents listener's TCP port.
        harness: the run's harness (the white-box one is returned as is, a CLI one replaced by
            a `NodeHarness` of the same name).
        isolation: the command's default for `sandbox.isolation`; under "required" a node
            without working bubblewrap stops the run.

    Raises:
        ConfigError: OpenEnv tasks (their sessions live in this process), or no live node.
        SandboxError: a node whose backend refuses to start, e.g. without bubblewrap under
            "required" isolation (the backend's message).
    """
    import ray  # lazy: ray, heavy; not needed at import
    from ray.exceptions import RayTaskError  # lazy: ray, heavy; not needed at import
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # lazy: ray, heavy; not needed at import

    rcfg = cfg.rollout.ray
    if cfg.tasks.kind == "openenv":
        raise ConfigError("tasks.kind = 'openenv' needs rollout.executor = 'local' (its sessions live in "
                          "the trainer's process)")
    owns = _init_ray(rcfg.address, rcfg.local_num_cpus)
    workers: list[Any] = []
    try:
        host = advertise_host(rcfg.proxy_host, rcfg.advertise_host)
        live = [n["NodeID"] for n in ray.nodes() if n.get("Alive")
                and (rcfg.node_resource is None or n.get("Resources", {}).get(rcfg.node_resource, 0) > 0)]
        if not live:
            raise ConfigError(f"rollout.ray.address = {rcfg.address!r}: the cluster has no live node"
                              + (f" with resource {rcfg.node_resource!r}" if rcfg.node_resource else ""))
        actor = cast(Any, ray.remote)(num_cpus=0, max_restarts=0, max_task_retries=0, max_concurrency=1000)(NodeWorker)  # ray.remote's stubs omit max_concurrency
        args = (cfg.sandbox.model_dump(mode="json"), cfg.harness.kind, dict(cfg.harness.options), host,
                proxy_port, rcfg.sandbox_starts_per_s)
        workers = [actor.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(*args)
                   for node_id in live]
        mode = cfg.sandbox.isolation or isolation
        # the most sandboxes one node holds at once: placement's per-node bound, at most the run's
        per_node = min(rcfg.max_sandboxes_per_node, cfg.concurrent_rollouts)

        async def ready(node_id: str, worker: Any) -> dict[str, Any]:
            try:
                return await asyncio.wrap_future(worker.ready.remote(mode, per_node).future())
            except RayTaskError as exc:  # the node's backend refused (isolation, no runtime, ...)
                raise SandboxError(f"Ray node {node_id} cannot run the run's sandboxes: {exc.cause}") from None

        infos = await asyncio.gather(*(ready(n, w) for n, w in zip(live, workers, strict=True)))
        for info in infos:
            if info["gaps"]:
                log.warning("SANDBOXES ON RAY NODE %s ARE NOT ISOLATED: %s", info["node_id"], "; ".join(info["gaps"]))
        nodes = RayNodes([RayNode(info["node_id"], w) for info, w in zip(infos, workers, strict=True)],
                         rcfg.max_sandboxes_per_node, rcfg.call_grace_s)
        log.info("rollouts on %d Ray nodes (%s), agents reach the proxy at %s:%d", len(live),
                 ", ".join(n[:12] for n in live), host, proxy_port)
        white_box = canonical_kind(cfg.harness.kind) == "white_box"
        yield RayRollouts(harness=harness if white_box else NodeHarness(harness.name),
                          backend=RaySandboxBackend(nodes, host),
                          verifier_for=lambda task: NodeVerifier(verifier_for(task)), nodes=nodes)
    finally:
        await _stop_workers(workers)
        if owns:
            ray.shutdown()


async def _stop_workers(workers: list[Any]) -> None:
    import ray  # lazy: ray, heavy; not needed at import

    async def stop(worker: Any) -> None:
        try:
            left = await asyncio.wait_for(asyncio.wrap_future(worker.shutdown.remote().future()), SHUTDOWN_TIMEOUT_S)
            if left:
                log.warning("a Ray node closed %d sandboxes left open at the end of the run", left)
        except Exception:  # noqa: BLE001 - a dead node has nothing left to close
            pass
        with contextlib.suppress(Exception):
            ray.kill(worker, no_restart=True)

    await asyncio.gather(*(stop(w) for w in workers))
