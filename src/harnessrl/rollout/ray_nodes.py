"""The live Ray nodes of a run: placement of sandboxes and the calls to each node's worker.

Responsibility: `RayNodes` holds one `RayNode` per node (its `NodeWorker` actor handle, its
sandbox counts) for `rollout/ray_executor.py`.

Placement: each rollout takes the live node with the fewest sandboxes (ties: the one that
started fewest), at most `max_sandboxes_per_node` at once per node.

A node that dies (raylet killed, machine gone) fails every call to its worker with
`RayActorError`, or with the worker's own `SandboxLostError` once it saw its raylet die, or
stops answering (each call waits at most its own limit plus `call_grace_s`): those calls
raise `SandboxLostError`, the runner records the rollout as
`infra_error`, the node gets no more rollouts, and the run goes on with the others.

What it does not do: start workers (`start_ray_rollouts`) or bring a lost node back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any, NoReturn

from harnessrl.errors import SandboxLostError

__all__ = ["SYNC_CALL_TIMEOUT_S", "RayNode", "RayNodes"]

log = logging.getLogger(__name__)

SYNC_CALL_TIMEOUT_S = 10.0
"""Longest wait of a blocking sandbox call (`agent_endpoint`, `read_file`, `write_file`) on a
silent node: it holds the event loop meanwhile (a dead node's calls fail at once)."""


@dataclasses.dataclass
class RayNode:
    """One node of the run: its worker, its sandboxes open now and started so far, alive or lost."""

    node_id: str
    worker: Any
    """The node's `NodeWorker` actor handle."""
    running: int = 0
    started: int = 0
    alive: bool = True


class RayNodes:
    """The live nodes' workers and their sandbox counts (placement, per-node limit)."""

    def __init__(self, nodes: list[RayNode], max_sandboxes_per_node: int, call_grace_s: float) -> None:
        self.nodes = nodes
        self.max_sandboxes_per_node = max_sandboxes_per_node
        self.call_grace_s = call_grace_s
        self._sync_timeout_s = min(call_grace_s, SYNC_CALL_TIMEOUT_S)
        self._changed = asyncio.Condition()

    async def acquire(self) -> RayNode:
        """The live node with the fewest sandboxes, once one is below the per-node limit.

        Raises SandboxLostError when no node is alive."""
        async with self._changed:
            while True:
                alive = [n for n in self.nodes if n.alive]
                if not alive:
                    raise SandboxLostError("no live Ray node is left to run the rollout")
                free = [n for n in alive if n.running < self.max_sandboxes_per_node]
                if free:
                    node = min(free, key=lambda n: (n.running, n.started))
                    node.running += 1
                    node.started += 1
                    return node
                await self._changed.wait()

    async def release(self, node: RayNode) -> None:
        async with self._changed:
            node.running -= 1
            self._changed.notify_all()

    async def lost(self, node: RayNode, exc: BaseException) -> None:
        if node.alive:
            node.alive = False
            log.error("Ray node %s is lost (%s); its rollouts end as infra_error, the run goes on without it",
                      node.node_id, type(exc).__name__)
        async with self._changed:
            self._changed.notify_all()

    async def call(self, node: RayNode, ref: Any, timeout_s: float) -> Any:
        """Await the worker call `ref` for at most `timeout_s` + `call_grace_s` seconds.

        Raises SandboxLostError when the node died or did not answer in time, the call's own
        exception when it raised on the node; cancelling the await cancels the call."""
        import ray  # lazy: ray, heavy; not needed at import
        from ray.exceptions import RayActorError, RayTaskError  # lazy: ray, heavy; not needed at import

        future = asyncio.wrap_future(ref.future())
        try:
            return await asyncio.wait_for(future, timeout_s + self.call_grace_s)
        except asyncio.CancelledError:
            ray.cancel(ref)
            raise
        except asyncio.TimeoutError:
            ray.cancel(ref)
            await self.lost(node, TimeoutError())
            raise SandboxLostError(f"Ray node {node.node_id} did not answer within "
                                   f"{timeout_s + self.call_grace_s:.0f} s") from None
        except RayActorError as exc:
            await self.lost(node, exc)
            raise _died(node, exc) from None
        except RayTaskError as exc:
            if isinstance(exc.cause, SandboxLostError):  # the worker saw its raylet die
                await self.lost(node, exc.cause)
            _raise_cause(exc)

    def call_sync(self, node: RayNode, ref: Any) -> Any:
        """`call` for the sandbox's synchronous methods (`agent_endpoint`, a file read or write
        on the node). It blocks this thread (the event loop) for its round trip, so it waits at
        most `SYNC_CALL_TIMEOUT_S` (or `call_grace_s` if shorter) before giving the node up."""
        import ray  # lazy: ray, heavy; not needed at import
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError  # lazy: ray, heavy; not needed at import

        try:
            return ray.get(ref, timeout=self._sync_timeout_s)
        except GetTimeoutError:
            ray.cancel(ref)
            node.alive = False
            raise SandboxLostError(f"Ray node {node.node_id} did not answer within "
                                   f"{self._sync_timeout_s:.0f} s") from None
        except RayActorError as exc:
            node.alive = False
            raise _died(node, exc) from None
        except RayTaskError as exc:
            if isinstance(exc.cause, SandboxLostError):
                node.alive = False
            _raise_cause(exc)


def _died(node: RayNode, exc: BaseException) -> SandboxLostError:
    """The error of a call whose node (its worker actor) died with `exc`."""
    return SandboxLostError(f"Ray node {node.node_id} died: {type(exc).__name__}")


def _raise_cause(exc: Any) -> NoReturn:
    """Raise what the call raised on the node (a RayTaskError's `cause`), else `exc` itself."""
    cause = exc.cause
    if isinstance(cause, Exception):
        raise cause from None
    raise exc
