"""Assembles the rollout side of a run from its config: engine, chat layer, proxy, tasks,
harness, sandbox backend and verifiers.

Responsibility: the one place where `RunConfig` becomes live components, shared by
`harnessrl rollout` and `harnessrl train`, and where they are torn down in reverse order.
Each seam's implementation is picked by the `make_*` function of the module that defines it.

What it does not do: run rollouts (`rollout/orchestrator.py`) or train (`train/loop.py`).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from harnessrl.chat.layer import ChatLayer
from harnessrl.config import EngineConfig, RunConfig
from harnessrl.engine.base import Engine
from harnessrl.engine.model_store import load_tokenizer, resolve_model
from harnessrl.engine.vllm.client import make_vllm_engine, start_vllm_engine
from harnessrl.harness.base import Harness
from harnessrl.harness.install import installed_agent_dirs
from harnessrl.harness.select import make_harness
from harnessrl.proxy.config import ProxyConfig, proxy_config
from harnessrl.proxy.server import ProxyServer
from harnessrl.rewards.base import Verifier
from harnessrl.rewards.select import make_verifier_for
from harnessrl.sandbox.base import SandboxBackend
from harnessrl.sandbox.select import make_backend
from harnessrl.tasks.base import Task, TaskSource
from harnessrl.tasks.select import make_task_source

log = logging.getLogger(__name__)


@dataclass
class Runtime:
    model_dir: Path
    engine: Engine
    chat: ChatLayer
    proxy: ProxyServer
    tasks: TaskSource
    harness: Harness
    backend: SandboxBackend
    verifier_for: Callable[[Task], Verifier]


def make_engine(cfg: EngineConfig, model_dir: Path, seed: int, run_dir: Path | None = None) -> Engine:
    """The engine `cfg` names. `engine.kind = "vllm"` without `url`/`urls` launches its servers
    (logs in `run_dir`, or the cache's `engines/vllm/logs/` without one); the engine owns them
    and its `close()` stops them.

    Raises:
        EngineError: an engine that cannot serve (vLLM not installed, a server that does not
            come up or is not in processed-logprobs mode).
    """
    match cfg.kind:
        case "embedded":
            from harnessrl.engine.embedded.engine import EmbeddedEngine  # lazy: pulls in torch

            return EmbeddedEngine(
                model_dir,
                dtype=cfg.dtype,
                device=cfg.device,
                num_threads=cfg.num_threads,
                max_batch_size=cfg.max_batch_size,
                max_context_tokens=cfg.max_context_tokens,
                seed=seed,
                prefix_cache_tokens=cfg.prefix_cache_tokens,
                prefill_chunk_tokens=cfg.prefill_chunk_tokens,
                pack_weights=cfg.pack_weights,
                max_rows_per_session=cfg.max_rows_per_session,
            )
        case "vllm":
            return make_vllm_engine(cfg, model_dir, run_dir)


async def start_engine(cfg: EngineConfig, model_dir: Path, seed: int, run_dir: Path | None = None) -> Engine:
    """`make_engine` for the runtime: launched vLLM servers are awaited while they start, so a
    stop signal during their start-up stops them at once."""
    if cfg.kind == "vllm" and not cfg.attached:
        return await start_vllm_engine(cfg, model_dir, run_dir)
    return make_engine(cfg, model_dir, seed, run_dir)


def proxy_config_for(cfg: RunConfig, model_name: str) -> ProxyConfig:
    """The proxy of a run: its `[proxy]` bounds and `[sampling]`, enforced (`proxy_config`); its
    agents listener takes a free port on loopback, or on `rollout.ray.proxy_host` for rollouts on
    a Ray cluster (the admin listener always stays on loopback)."""
    host = cfg.rollout.ray.proxy_host if cfg.rollout.executor == "ray" else "127.0.0.1"
    return proxy_config(cfg.proxy, cfg.sampling, host=host, port=0, model_name=model_name)


@asynccontextmanager
async def start_runtime(cfg: RunConfig, isolation: Literal["required", "best_effort"] = "best_effort",
                        run_dir: Path | None = None) -> AsyncIterator[Runtime]:
    """Start every rollout-side component; stop them all on exit, whatever happened.

    `run_dir` receives the logs of launched engine servers. `isolation` is the command's
    default for `sandbox.isolation` (which overrides it). Before
    anything loads, the sandbox backend's gaps are logged as a warning, and under "required"
    a machine where bubblewrap cannot run stops the run (SandboxError naming the gaps).
    """
    # user code (task source, verifier) is built before the model loads: its errors come first
    tasks = make_task_source(cfg.tasks)
    verifier_for = make_verifier_for(cfg.tasks.verifier, dict(cfg.tasks.verifier_kwargs))
    verifier_for(tasks.get(0))  # a task family without a verifier stops the run here (TaskError)
    if cfg.rollout.executor == "local":  # with "ray" each node checks its own (ray_executor.py)
        make_backend(cfg.sandbox).check_isolation(cfg.sandbox.isolation or isolation, cfg.concurrent_rollouts)
    model_dir = resolve_model(cfg.engine.model)
    engine = await start_engine(cfg.engine, model_dir, cfg.seed, run_dir)
    try:
        chat = ChatLayer(load_tokenizer(model_dir))
        async with ProxyServer(engine, chat, proxy_config_for(cfg, "harnessrl-policy")) as proxy:
            harness = make_harness(cfg.harness.kind, dict(cfg.harness.options),
                                   capture=proxy.deps.capture, store=proxy.store)
            # agents installed in the per-machine cache are bound read-only into sandboxes; a
            # bubblewrapped agent reaches the proxy only through its agent Unix socket
            backend: SandboxBackend = make_backend(cfg.sandbox, ro_binds=installed_agent_dirs(),
                                                   proxy_port=proxy.port, proxy_socket=proxy.agent_socket_path)
            try:
                async with AsyncExitStack() as stack:
                    run_verifier_for = verifier_for
                    if cfg.rollout.executor == "ray":  # sandboxes, CLI agents, verifiers on the nodes
                        from harnessrl.rollout.ray_executor import start_ray_rollouts  # lazy: ray, with rollout.executor = "ray" only

                        ray_side = await stack.enter_async_context(start_ray_rollouts(
                            cfg, proxy.port, harness, verifier_for, cfg.sandbox.isolation or isolation))
                        harness, backend, run_verifier_for = ray_side.harness, ray_side.backend, ray_side.verifier_for
                    yield Runtime(
                        model_dir=model_dir,
                        engine=engine,
                        chat=chat,
                        proxy=proxy,
                        tasks=tasks,
                        harness=harness,
                        backend=backend,
                        verifier_for=run_verifier_for,
                    )
            finally:
                # fail generations still pending (their agents are gone) so that the proxy
                # answers them at once and shuts down without waiting on them
                engine.close()
    finally:
        engine.close()
        if cfg.tasks.kind == "openenv":  # sessions of rollouts that never reached their verifier
            from harnessrl.tasks.openenv import close_all_sessions  # lazy: openenv, with tasks.kind = "openenv" only

            close_all_sessions()

