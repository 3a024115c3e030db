"""The composition root of a run's serving and rollout side: engine, chat layer, proxy, tasks,
verifiers, harness, sandbox backend, and Ray when asked.

Responsibility: the one place where `RunConfig` becomes live components, and where they are
torn down in reverse order. `serving` opens the engine behind its proxy (the chat layer built
from the model's tokenizer and the engine's end-of-sequence ids, so a completion parses the same
under every command): `harnessrl serve` opens it alone, with its own listener. `start_runtime`
opens it inside the rest of a run's rollout side: `harnessrl rollout` uses that as is,
`harnessrl train` (`train/setup.open_run`) adds only the trainer's parts. The task source,
its verifier and the hooks are built once, by `preflight.check_start` (`Prepared`), and handed
in. Each seam's implementation is picked by the `make_*` function of the module that defines it.

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
from harnessrl.config import EngineConfig, RunConfig, check_run
from harnessrl.engine.base import Engine
from harnessrl.engine.model_store import load_tokenizer, resolve_model
from harnessrl.engine.scripted import ScriptedEngine
from harnessrl.engine.vllm.client import make_vllm_engine, start_vllm_engine
from harnessrl.harness.base import Harness
from harnessrl.harness.install import installed_agent_dirs
from harnessrl.harness.select import make_harness
from harnessrl.hooks import Hooks, load_hook
from harnessrl.proxy.config import ProxyConfig, proxy_config
from harnessrl.proxy.server import ProxyServer
from harnessrl.rewards.base import Verifier
from harnessrl.rewards.select import make_verifier_for
from harnessrl.sandbox.base import SandboxBackend
from harnessrl.sandbox.select import make_backend
from harnessrl.tasks.base import Task, TaskSource
from harnessrl.tasks.select import make_task_source

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prepared:
    """A run's user code, built once before anything loads (`prepare`, `preflight.check_start`)."""

    hooks: Hooks
    """The loaded `[hooks]` (`config.check_run`)."""
    tasks: TaskSource | None
    """The task source; None: `start_runtime` builds it (an OpenEnv source, whose sessions are
    opened only once the run starts)."""
    verifier_for: Callable[[Task], Verifier] | None
    """The verifier of a task (checked on task 0); None with `tasks`."""


def prepare(cfg: RunConfig, hooks: Hooks | None = None) -> Prepared:
    """Load the hooks (unless given), build the task source and its verifier, and check that
    the source's first task has a verifier.

    Raises:
        ConfigError: a dotted path that does not import (`config.check_run`).
        TaskError: a task source that cannot be built; a task family without a verifier.
    """
    hooks = hooks if hooks is not None else check_run(cfg)
    tasks = make_task_source(cfg.tasks)
    verifier_for = make_verifier_for(cfg.tasks.verifier, dict(cfg.tasks.verifier_kwargs))
    verifier_for(tasks.get(0))  # a task family without a verifier stops the run here (TaskError)
    return Prepared(hooks, tasks, verifier_for)


@dataclass(frozen=True)
class Serving:
    """The engine behind its proxy (`serving`)."""

    model_dir: Path
    engine: Engine
    chat: ChatLayer
    """The model's tokenizer with the engine's end-of-sequence ids (`chat_layer`)."""
    proxy: ProxyServer


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
        case "scripted":  # demonstrations: the model's tokenizer, a Python policy
            return ScriptedEngine(load_tokenizer(model_dir), load_hook(cfg.policy, "engine.policy"),
                                  cfg.max_context_tokens)


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


def chat_layer(model_dir: Path, engine: Engine) -> ChatLayer:
    """The chat layer of every command: the model's tokenizer, with the ids that end a
    completion taken from the engine that samples them (its generation config), so that a
    completion ending in one parses the same under `train`, `rollout` and `serve`."""
    return ChatLayer(load_tokenizer(model_dir), eos_token_ids=engine.eos_token_ids)


@asynccontextmanager
async def serving(engine_cfg: EngineConfig, seed: int, proxy_cfg: ProxyConfig, *, run_dir: Path | None = None,
                  admin_port: int = 0, admin_token: str | None = None) -> AsyncIterator[Serving]:
    """The engine of `engine_cfg` (`start_engine`; logs of launched servers in `run_dir`) behind
    a proxy with `proxy_cfg` (`admin_port` / `admin_token`: its admin listener's, `ProxyServer`'s);
    both stopped on exit, whatever happened.

    Raises:
        ModelLoadError: `engine.model` cannot be found or loaded.
        EngineError: an engine that cannot serve.
        ConfigError: the proxy's host or port cannot be bound.
    """
    model_dir = resolve_model(engine_cfg.model)
    engine = await start_engine(engine_cfg, model_dir, seed, run_dir)
    try:
        chat = chat_layer(model_dir, engine)
        async with ProxyServer(engine, chat, proxy_cfg, admin_port=admin_port, admin_token=admin_token) as proxy:
            try:
                yield Serving(model_dir, engine, chat, proxy)
            finally:
                # fail generations still pending (their agents are gone) so that the proxy
                # answers them at once and shuts down without waiting on them
                engine.close()
    finally:
        engine.close()


@asynccontextmanager
async def start_runtime(cfg: RunConfig, isolation: Literal["required", "best_effort"] = "best_effort",
                        run_dir: Path | None = None, prepared: Prepared | None = None) -> AsyncIterator[Runtime]:
    """Start every rollout-side component; stop them all on exit, whatever happened.

    `run_dir` receives the logs of launched engine servers. `isolation` is the command's
    default for `sandbox.isolation` (which overrides it). `prepared`: the task source and
    verifier `preflight.check_start` built (built here when None). Before anything loads, the
    sandbox backend's gaps are logged as a warning, and under "required" a machine where
    bubblewrap cannot run stops the run (SandboxError naming the gaps).
    """
    # user code (task source, verifier) is built before the model loads: its errors come first
    if prepared is None or prepared.tasks is None or prepared.verifier_for is None:
        prepared = prepare(cfg, prepared.hooks if prepared is not None else None)
    tasks, verifier_for = prepared.tasks, prepared.verifier_for
    assert tasks is not None and verifier_for is not None
    if cfg.rollout.executor == "local":  # with "ray" each node checks its own (ray_executor.py)
        make_backend(cfg.sandbox).check_isolation(cfg.sandbox.isolation or isolation, cfg.concurrent_rollouts)
    try:
        async with serving(cfg.engine, cfg.seed, proxy_config_for(cfg, "harnessrl-policy"), run_dir=run_dir) as served:
            proxy = served.proxy
            harness = make_harness(cfg.harness.kind, dict(cfg.harness.options),
                                   capture=proxy.deps.capture, store=proxy.store)
            # agents installed in the per-machine cache are bound read-only into sandboxes; a
            # bubblewrapped agent reaches the proxy only through its agent Unix socket
            backend: SandboxBackend = make_backend(cfg.sandbox, ro_binds=installed_agent_dirs(),
                                                   proxy_port=proxy.port, proxy_socket=proxy.agent_socket_path)
            async with AsyncExitStack() as stack:
                run_verifier_for = verifier_for
                if cfg.rollout.executor == "ray":  # sandboxes, CLI agents, verifiers on the nodes
                    from harnessrl.rollout.ray_executor import start_ray_rollouts  # lazy: ray, with rollout.executor = "ray" only

                    ray_side = await stack.enter_async_context(start_ray_rollouts(
                        cfg, proxy.port, harness, verifier_for, cfg.sandbox.isolation or isolation))
                    harness, backend, run_verifier_for = ray_side.harness, ray_side.backend, ray_side.verifier_for
                yield Runtime(model_dir=served.model_dir, engine=served.engine, chat=served.chat, proxy=proxy,
                              tasks=tasks, harness=harness, backend=backend, verifier_for=run_verifier_for)
    finally:
        if cfg.tasks.kind == "openenv":  # sessions of rollouts that never reached their verifier
            from harnessrl.tasks.openenv import close_all_sessions  # lazy: openenv, with tasks.kind = "openenv" only

            close_all_sessions()
