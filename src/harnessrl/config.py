"""Run configuration: one TOML file, validated by pydantic, defaults that form a working run.

Responsibility: compose the per-component configs into `RunConfig`, load it from TOML, apply
`--set a.b=value` overrides, validate cross-field constraints, and save the resolved config.
Unknown keys are rejected with the key named (`extra="forbid"` everywhere).

Each `kind` is a discriminated union of typed configs defined beside its code, in modules that
do not import torch: `engine` (`engine/config.py`), `tasks` (`tasks/config.py`), `sandbox`
(`sandbox/config.py`), `train.loss` (`loss/config.py`), `harness.options`
(`harness/options.py`). A table without `kind` takes the default one; a key of another kind
fails naming it (`unknown key 'tasks.difficulty' (with tasks.kind = 'stdio')`). The saved
`config.toml` holds the resolved options of each chosen kind, defaults included.

With no file at all the defaults train SmolLM2-135M-Instruct on the embedded CPU engine with
mini-swe-agent (one step, compact prompt) on procedural `repeat` tasks at temperature 0.4,
G=4.

Harness checks happen here, before any model loads: `harness.options` is validated by the
harness's typed options model (`harness/options.py`), and the engine context and reply cap are
checked against what the harness declares it needs (`HarnessRequirements`). When the config
leaves `engine.max_context_tokens` or `sampling.max_tokens` unset, the harness's needs pick
them (e.g. 32768 and 1024 for claude-code). `check_run` then imports every dotted path the
config names (hooks, a python task source, a verifier) so a typo stops the run at once.
"""

from __future__ import annotations

import datetime as _dt
import json
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

from harnessrl.engine.config import EmbeddedEngineConfig, EngineConfig
from harnessrl.errors import ConfigError
from harnessrl.harness.base import HarnessRequirements
from harnessrl.harness.options import default_limits, requirements_for, validate_options
from harnessrl.hooks import Hooks, load_hook, load_hooks
from harnessrl.log import check_sinks
from harnessrl.loss.config import LossConfig, PpoClipLoss
from harnessrl.proxy.config import ProxyBounds, SamplingConfig
from harnessrl.sandbox.config import PodmanSandboxConfig
from harnessrl.sandbox.config import SandboxConfig as LocalSandboxConfig
from harnessrl.tasks.config import ProceduralTasks, TasksConfig

__all__ = ["EngineConfig", "HarnessConfig", "HooksConfig", "LogConfig", "RayRolloutConfig", "RolloutConfig",
           "RunConfig", "SamplingConfig", "TasksConfig", "TrainConfig", "check_out_dir", "check_run",
           "check_training_config", "dump_config", "load_config"]

_FROZEN = ConfigDict(frozen=True, extra="forbid")

SandboxConfig = Annotated[LocalSandboxConfig | PodmanSandboxConfig, Field(discriminator="kind")]
"""`[sandbox]`: the backend named by `kind` (default `local`) with its own keys."""


class HarnessConfig(BaseModel):
    model_config = _FROZEN

    kind: str = "mini-swe-agent"
    """`mini-swe-agent`, `opencode`, `pi`, `codex`, `claude-code`, `command`, or `white_box`."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Options of the chosen harness's own typed config model, validated by it at load time and
    held resolved (every option with its value, defaults included; `harnessrl harness options
    NAME` lists them)."""

    @model_validator(mode="before")
    @classmethod
    def _resolve_options(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        kind, options = data.get("kind", "mini-swe-agent"), data.get("options", {})
        if not isinstance(kind, str) or not isinstance(options, dict):
            return data  # the fields' own validation reports it
        try:
            resolved = validate_options(kind, dict(options))
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        return {**data, "options": resolved.model_dump(mode="json", exclude_none=True)}

    def requirements(self) -> HarnessRequirements:
        """What this harness with these options needs from the engine and sampling."""
        return requirements_for(self.kind, validate_options(self.kind, dict(self.options)))


class RayRolloutConfig(BaseModel):
    """`[rollout.ray]`: where rollouts run with `rollout.executor = "ray"` (`rollout/ray_executor.py`)."""

    model_config = _FROZEN

    address: str = "auto"
    """Ray cluster to join: "auto" (the running cluster, or `RAY_ADDRESS`), `HOST:PORT` of its
    head, or "local" (a private one-node Ray started for this run and stopped after it)."""
    proxy_host: str = "127.0.0.1"
    """Interface the proxy's agents listener binds, so that sandboxes on every node can reach
    it: 127.0.0.1 for a cluster on this machine, this host's cluster address (or 0.0.0.0)
    for one spanning machines. The admin listener stays on 127.0.0.1 whatever this says."""
    advertise_host: str | None = None
    """Address the nodes dial to reach the agents listener; unset: `proxy_host`, or this
    node's Ray address when `proxy_host` is 0.0.0.0 / ::."""
    node_resource: str | None = None
    """Only nodes advertising this Ray custom resource (`ray start --resources='{"NAME": 1}'`)
    run rollouts; unset: every live node."""
    max_sandboxes_per_node: int = Field(default=4, ge=1)
    """Most sandboxes alive at once on one node (a rollout waits for a free node)."""
    sandbox_starts_per_s: float = Field(default=0.0, ge=0.0)
    """Most sandbox creations per second on one node (0: unlimited)."""
    call_grace_s: float = Field(default=60.0, gt=0.0)
    """A node that has not answered this long after the work it was given should have ended
    (agent timeout, verify timeout, a sandbox call) is given up on: the rollout is
    `infra_error`."""
    local_num_cpus: int = Field(default=1, ge=1)
    """CPUs the "local" Ray advertises (a scheduling figure; rollout workers ask for none)."""


class RolloutConfig(BaseModel):
    model_config = _FROZEN

    executor: Literal["local", "ray"] = "local"
    """Where sandboxes, CLI agents and verifiers run: this process's machine ("local"), or
    worker actors on the nodes of a Ray cluster ("ray", configured by `rollout.ray`)."""
    ray: RayRolloutConfig = RayRolloutConfig()

    group_size: int = Field(default=4, ge=1)
    """G: rollouts per task (group)."""
    max_concurrent_rollouts: int = Field(default=0, ge=0)
    """Rollouts in flight at once; 0 (the default): as many as training grants ahead,
    `(train.max_staleness + 1) * train.groups_per_step * group_size`, at most the embedded
    engine's `max_batch_size` (`RunConfig.concurrent_rollouts`), so generation is not held back
    by this cap while the trainer works. Held-out evaluations
    run beside training with as many again."""
    agent_timeout_s: float = Field(default=180.0, gt=0)
    verify_timeout_s: float = Field(default=60.0, ge=10.0)
    """Wall-clock limit of one verification, seconds. The verifier's own budget is this less a
    margin (`rewards/base.verify_budget_s`: 10%, at least 1 s), so it ends first and scores what
    it could not run as failed; below 10 s that budget cannot hold the interpreter probe and
    one stdio test at its default limit (6 s), so a run refuses it."""
    max_final_answer_chars: int = Field(default=65536, ge=1)
    """Characters of an agent's final answer a rollout records (`rollouts.jsonl`, the trainer's
    memory); a longer one is cut and ends with `…[final answer cut: N characters in all]`. The
    verifier scores the whole answer."""


@dataclass(frozen=True, slots=True)
class StalenessWindow:
    """How far generation runs ahead of training (DESIGN.md §1, §6), computed in one place from
    `train.max_staleness` and `train.groups_per_step` (`TrainConfig.window`)."""

    max_staleness: int
    groups_per_step: int

    @property
    def versions(self) -> int:
        """Policy versions a rollout in flight may still be sampled from, `max_staleness + 1`:
        the versions a weight sync keeps (LoRA adapters loaded on vLLM)."""
        return self.max_staleness + 1

    @property
    def groups_ahead(self) -> int:
        """Groups the orchestrator keeps granted ahead of training (its allowance):
        `versions * groups_per_step`."""
        return self.versions * self.groups_per_step


class TrainConfig(BaseModel):
    model_config = _FROZEN

    steps: int = Field(default=3, ge=1)
    groups_per_step: int = Field(default=1, ge=1)
    learning_rate: float = Field(default=1e-5, gt=0)
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning rate of each update (`train/schedule.py`): `constant`, or decayed to 0 at
    `steps` after `warmup_steps` of linear warm-up, linearly (the Hugging Face `Trainer`
    default, which TRL's `GRPOTrainer` uses) or on a half cosine."""
    warmup_steps: int = Field(default=0, ge=0)
    """Updates of linear warm-up from 0 to `learning_rate` before the schedule."""
    weight_decay: float = Field(default=0.0, ge=0)
    max_grad_norm: float = Field(default=1.0, gt=0)
    advantage: Literal["grpo", "dr_grpo", "rloo"] = "grpo"
    """Group-relative advantage estimator (`loss/advantages.py`)."""
    loss: LossConfig = PpoClipLoss()
    """Policy-gradient loss and its clipping / importance-sampling knobs (`loss/losses.py`)."""
    max_staleness: int = Field(default=2, ge=0)
    """Most policy versions a trained token may lag behind; 0 runs rollouts and training in turn.
    2 (PRIME-RL's default `async_level`) lets generation run two steps ahead, which absorbs steps
    whose generation outlasts their training (`bench/async.py`)."""
    group_order: Literal["dispatch", "completion"] = "dispatch"
    """Order the trainer takes completed groups in (`rollout/orchestrator.py`): "dispatch" never
    takes one ahead of a group granted before it, so none is overtaken and dropped as stale;
    "completion": the first finished (an overtaken group can exceed `max_staleness`)."""
    dynamic_sampling_max_groups: int = Field(default=0, ge=0)
    """Dynamic sampling (DAPO, `train/dynamic_sampling.py`): a group whose training rewards are
    all equal (no gradient) is replaced by another, at most this many extra groups a step and
    at most this many groups beyond the base allowance in flight; 0 (the default): off. Replaced
    groups are still logged and counted (`groups_drawn_extra`)."""
    max_rows_per_rollout: int = Field(default=8, ge=1)
    """Most training rows one rollout gives a step (`train/rows.py`, `cap_rollout_rows`): its
    first rows are kept, later ones dropped and counted (`rows_capped_dropped`,
    `tokens_capped_dropped`). A normal rollout trains as one row (more only when its agent
    rewrites its history); without a bound, an agent making thousands of short calls that each
    start a row would take the step's memory and the loss's weighting."""
    max_tokens_per_rollout: int = Field(default=32768, ge=64)
    """Most tokens (context and trained, summed over its kept rows) one rollout gives a step;
    the first row past it and every later one are dropped and counted, as for
    `max_rows_per_rollout`. The default is 8 rows of the default 4096-token context."""
    token_budget: int = Field(default=4096, ge=64)
    """Most tokens per packed micro-batch. Packed rows attend per row segment
    (`train/packing.py`), so cost grows with the rows' lengths, not the square of the pack's,
    and a larger budget shares more context prefixes per pack; 4096 (the default context)
    trained faster than 2048 and no slower than 8192 on the default model's shape
    (docs/benchmarks.md, training step)."""
    train_auxiliary: bool = False
    """Also train auxiliary calls (titles, summaries); off by default."""
    num_threads: int = Field(default=1, ge=1)
    """torch intra-op threads of the training thread (on every rank: N ranks use N x this)."""
    strategy: Literal["ddp", "fsdp2"] = "ddp"
    """Under `torchrun` / `accelerate launch` with several processes: `ddp` (full weights and
    optimizer state on every rank) or `fsdp2` (`fully_shard`: weights, gradients and optimizer
    state sharded); `train/distributed.py`. Ignored by one process."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where the trainer's weights live: `cuda` uses `cuda:LOCAL_RANK` and NCCL between ranks,
    `cpu` uses gloo."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """The trainer's weight (and optimizer state) dtype; float32 keeps the sampler/trainer
    parity check within 1e-3 on CPU. bfloat16 weights lose updates smaller than ~1/256 of a
    weight (at lr 1e-5 most of them): for bfloat16 speed prefer `autocast`."""
    autocast: Literal["off", "bfloat16"] = "off"
    """Mixed precision: each micro-batch's forward under `torch.autocast` in bfloat16 (matmuls
    and attention in bfloat16; norms, softmax, logprobs and the loss in float32), the weights,
    gradients and AdamW state kept in `dtype` (the Hugging Face `Trainer`'s `bf16=True`).
    Faster where bfloat16 matmuls are (GPUs; CPUs with AMX or AVX512-BF16). The trainer's
    logprobs then differ from a float32 sampler's by ~1e-2: the step-0 check reads above 1e-3,
    and the loss's behaviour weight (`train.loss.tis_cap` / mask) bounds the mismatch."""
    sync_canary: bool = True
    """The weight-sync canary (`engine/canary.py`): after every publish the trainer and each
    engine replica score a fixed sequence (64 ids when both hold float32 weights, else 256);
    the max abs deviation of their per-token logprobs is `sync/canary_abs_dev`, and above
    1e-3 nats (float32 trainer and engine; 1.5 when either is bfloat16 or float16, which
    catches gross failures only: `canary.BF16_BOUND`) the run stops with an error naming the
    replica, the version and the deviation, before the next update and before the step is
    written (the engine's verdict arrives while the next step trains). Costs the trainer one
    forward of the sequence per step (`bench/sync.py --canary`); false turns it off."""
    checkpoint_every: int = Field(default=0, ge=0)
    """Save a checkpoint every N steps (0: only at the end); these are kept."""
    checkpoint_every_s: float = Field(default=300.0, ge=0)
    """Also save a checkpoint after the first step that ends this many seconds after the last
    checkpoint (or the start), so a stop loses at most about this much; 0 turns it off. These
    are rolling: each is removed once a newer checkpoint is complete. Cost for SmolLM2-135M,
    float32: ~1.6 GB and 10-15 s of the trainer per checkpoint (docs/benchmarks.md)."""
    lora_rank: int = Field(default=0, ge=0)
    """LoRA rank via peft; 0 trains every weight."""
    eval_every: int = Field(default=0, ge=0)
    """Score a held-out set before the first update and after every N steps (and the last);
    0 never evaluates. Logged as `eval/pass_rate`, `eval/pass@k`, `eval/error_rate`
    (`train/evaluation.py`); rollouts in `RUN/eval/step-K/`."""
    eval_size: int = Field(default=16, ge=1)
    """Held-out tasks per evaluation (disjoint from the training tasks)."""
    eval_samples: int | None = Field(default=None, ge=1)
    """Rollouts per held-out task, with the run's sampling (unset: `rollout.group_size`)."""

    @property
    def window(self) -> StalenessWindow:
        """The staleness window of `max_staleness` and `groups_per_step`."""
        return StalenessWindow(self.max_staleness, self.groups_per_step)


@dataclass(frozen=True, slots=True)
class TrainerSettings:
    """The trainer's slice of the run config (`trainer_settings`): what
    `train/trainer_group.TrainerGroup` reads, on every rank."""

    loss: LossConfig
    learning_rate: float
    lr_schedule: Literal["constant", "linear", "cosine"]
    warmup_steps: int
    steps: int
    """`train.steps`: the length of the learning-rate schedule."""
    weight_decay: float
    max_grad_norm: float
    token_budget: int
    dtype: Literal["float32", "bfloat16"]
    autocast: Literal["off", "bfloat16"]
    lora_rank: int
    sync_canary: bool
    engine_dtype: Literal["float32", "bfloat16", "float16"]
    """`engine.dtype`: the canary's probe is compared at the coarser of it and `dtype`."""
    temperature: float
    """`sampling.temperature`: the trainer's logprobs are taken at it."""


def trainer_settings(cfg: RunConfig) -> TrainerSettings:
    """The trainer's slice of `cfg`."""
    t = cfg.train
    return TrainerSettings(
        loss=t.loss, learning_rate=t.learning_rate, lr_schedule=t.lr_schedule, warmup_steps=t.warmup_steps,
        steps=t.steps, weight_decay=t.weight_decay, max_grad_norm=t.max_grad_norm, token_budget=t.token_budget,
        dtype=t.dtype, autocast=t.autocast, lora_rank=t.lora_rank, sync_canary=t.sync_canary,
        engine_dtype=cfg.engine.dtype, temperature=cfg.sampling.temperature)


class HooksConfig(BaseModel):
    model_config = _FROZEN

    agent_turn_fn: str | None = None
    """Dotted path `pkg.module:fn` or `pkg.module.fn`: `(turns) -> turns`."""
    train_turn_fn: str | None = None
    """`(turn) -> bool`: whether a turn's completion trains (else it stays as context)."""
    rollout_reward_fn: str | None = "harnessrl.recipes.shaping:action_format_credit"
    """`(outcome) -> float | None`: the rollout's reward (shaping). The default gives a small
    model partial credit for well-formed actions (see `recipes/shaping.py`); "" disables it."""


SinkName = Literal["jsonl", "tensorboard", "trackio", "wandb"]
"""The metrics sinks `log.sinks` accepts (`log.py`)."""


class LogConfig(BaseModel):
    model_config = _FROZEN

    sinks: list[SinkName] = Field(
        default_factory=lambda: list[SinkName](["jsonl"]), validation_alias=AliasChoices("sinks", "report_to"))
    """Where step metrics go besides `metrics.jsonl` (always); `report_to` is read as this. See `log.py`."""
    project: str = "harnessrl"
    """trackio's and W&B's project; the run is named after its directory."""
    table_rollouts: int = Field(default=8, ge=0)
    """Rollouts per step in the sinks' rollout table (task, status, reward, turns, answer); 0: none."""
    log_completions: int = Field(default=0, ge=0)
    """Print this many sampled rollouts per step as conversations."""
    level: Literal["DEBUG", "INFO", "WARNING"] = "INFO"
    update_norm_every: int = Field(default=10, ge=0)
    """Measure `param_delta_l2`, the L2 norm of the update (`train/step.update_l2`), after the
    first update and every N-th after it (versions 1, 1 + N, 1 + 2N, ...); 1: every update; 0:
    never. It reads the AdamW moments once (on SmolLM2-135M 0.24-0.30 s on one core, 0.42 s
    beside a busy engine), on the trainer thread after the weight sync, so it delays the next
    update when that step's rollouts are already waiting: every update, it was 8% of a step of
    `bench/async.py`, hence 10."""


class RunConfig(BaseModel):
    model_config = _FROZEN

    seed: int = 0
    engine: EngineConfig = EmbeddedEngineConfig()
    sampling: SamplingConfig = SamplingConfig()
    proxy: ProxyBounds = ProxyBounds()
    """`[proxy]`: the proxy's bounds on what agents send and hold (`proxy/config.ProxyBounds`)."""
    tasks: TasksConfig = ProceduralTasks()
    harness: HarnessConfig = HarnessConfig()
    sandbox: SandboxConfig = LocalSandboxConfig()
    rollout: RolloutConfig = RolloutConfig()
    train: TrainConfig = TrainConfig()
    hooks: HooksConfig = HooksConfig()
    log: LogConfig = LogConfig()

    @model_validator(mode="before")
    @classmethod
    def _default_kinds(cls, data: Any) -> Any:
        """A union table given without `kind` takes the default kind. (Pydantic runs "before"
        validators last-defined first: this one runs after `_harness_defaults`.)"""
        return _with_default_kinds(data) if isinstance(data, dict) else data

    @model_validator(mode="before")
    @classmethod
    def _harness_defaults(cls, data: Any) -> Any:
        """Fill `engine.max_context_tokens` and `sampling.max_tokens`, when unset, from what the
        harness needs (`harness.options.default_limits`)."""
        if not isinstance(data, dict):
            return data
        harness, engine, sampling = (data.get(k, {}) for k in ("harness", "engine", "sampling"))
        if not (isinstance(harness, dict) and isinstance(engine, dict) and isinstance(sampling, dict)):
            return data  # given as models: their values are explicit
        try:
            req = HarnessConfig.model_validate(harness).requirements()
        except (ValidationError, ConfigError):
            return data  # the field's own validation reports it
        context, reply = default_limits(req)
        return {**data, "engine": {"max_context_tokens": context, **engine},
                "sampling": {"max_tokens": reply, **sampling}}

    @property
    def concurrent_rollouts(self) -> int:
        """`rollout.max_concurrent_rollouts`, with 0 resolved to the rollouts training grants
        ahead, `(train.max_staleness + 1) * train.groups_per_step * rollout.group_size`, at most
        the embedded engine's `max_batch_size` (more would wait in its queue, each holding a
        sandbox and an agent process)."""
        if self.rollout.max_concurrent_rollouts:
            return self.rollout.max_concurrent_rollouts
        ahead = self.train.window.groups_ahead * self.rollout.group_size
        return min(ahead, self.engine.max_batch_size) if isinstance(self.engine, EmbeddedEngineConfig) else ahead

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        req = self.harness.requirements()
        kind = self.harness.kind
        if self.sampling.temperature <= 0.0:
            raise ValueError(f"sampling.temperature must be above 0 (got {self.sampling.temperature}): the "
                             f"trainer's logprobs and the recorded ones are taken at that temperature")
        if self.engine.max_context_tokens < req.min_context_tokens:
            raise ValueError(
                f"harness {kind!r} needs engine.max_context_tokens >= {req.min_context_tokens} "
                f"(got {self.engine.max_context_tokens}): --set engine.max_context_tokens="
                f"{default_limits(req)[0]} ({req.why})")
        if self.sampling.max_tokens < req.min_reply_tokens:
            raise ValueError(
                f"harness {kind!r} needs sampling.max_tokens >= {req.min_reply_tokens} "
                f"(got {self.sampling.max_tokens}), or its replies are cut: --set sampling.max_tokens="
                f"{req.min_reply_tokens}, or lower harness.options.output_tokens ({req.why})")
        if self.sampling.max_tokens >= self.engine.max_context_tokens:
            raise ValueError(
                f"sampling.max_tokens ({self.sampling.max_tokens}) must be below "
                f"engine.max_context_tokens ({self.engine.max_context_tokens})"
            )
        return self


_DEFAULT_KINDS = {("engine",): "embedded", ("tasks",): "procedural", ("sandbox",): "local",
                  ("train", "loss"): "ppo_clip"}
"""The `kind` a table of a discriminated union takes when it names none."""


def _with_default_kinds(data: dict[str, Any]) -> dict[str, Any]:
    """`data` with `kind` filled in each union table that is given without one."""
    data = dict(data)
    for keys, kind in _DEFAULT_KINDS.items():
        node = data
        for key in keys[:-1]:
            child = node.get(key)
            if not isinstance(child, dict):
                break
            node[key] = child = dict(child)
            node = child
        else:
            table = node.get(keys[-1])
            if isinstance(table, dict) and "kind" not in table:
                node[keys[-1]] = {"kind": kind, **table}
    return data


def load_config(path: Path | None, overrides: list[str] = ()) -> RunConfig:  # type: ignore[assignment]
    """Load TOML (or defaults), apply `a.b=value` overrides (values parsed as TOML), validate.

    Raises:
        ConfigError: unreadable file, bad override, unknown key or invalid value (named).
    """
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError as exc:
            raise ConfigError(f"config file not found: {path}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
    for item in overrides:
        _apply_override(data, item)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_describe_validation(exc, path, data)) from None


def check_run(cfg: RunConfig) -> Hooks:
    """Checks of a run config that need imports: every hook, the python task source and the
    verifier it names must import and be callable. Called by `harnessrl train` and `harnessrl
    rollout` before anything else (no model loaded, no run directory made). Returns the hooks,
    loaded (the run's one load of them).

    Raises:
        ConfigError: the first dotted path that fails, named with its config key.
    """
    hooks = load_hooks(cfg.hooks)
    if cfg.tasks.kind == "python" and cfg.tasks.source:
        load_hook(cfg.tasks.source, what="tasks.source")
    if cfg.tasks.kind == "openenv":
        load_hook(cfg.tasks.factory, what="tasks.factory")
    if cfg.tasks.verifier:
        load_hook(cfg.tasks.verifier, what="tasks.verifier")
    return hooks


def check_training_config(cfg: RunConfig) -> None:
    """Checks of a config that only training needs and that load nothing heavy (the rest of
    `train/setup.check_training`), so `harnessrl train` runs them before torch is imported.

    Raises:
        ConfigError: a `log.sinks` package not installed (`log.check_sinks`, naming its extra).
        ConfigError: `sampling.top_p < 1` or `sampling.top_k > 0`: the engine renormalises over
            the kept tokens but the trainer's logprobs are the full softmax at the temperature
            (`train/packing.py`), so the importance ratio would be wrong from the first step
            (0.50 at top_p = 0.5); a lower `sampling.temperature` is exact.
    """
    check_sinks(cfg.log.sinks)
    s = cfg.sampling
    if s.top_p < 1.0 or s.top_k > 0:
        raise ConfigError(
            f"sampling.top_p = {s.top_p} / sampling.top_k = {s.top_k}: training needs top_p = 1 and "
            f"top_k = 0 (the trainer computes logprobs under the full distribution at "
            f"sampling.temperature, not the truncated one the engine samples from); lower "
            f"sampling.temperature instead")
    if cfg.engine.kind == "scripted":
        raise ConfigError("engine.kind = 'scripted' answers with a scripted policy and has no weights to train: "
                          "record demonstrations with `harnessrl rollout`, fine-tune on them with `harnessrl sft`")


def check_out_dir(path: Path, option: str = "--out") -> None:
    """Refuse a run or output directory that cannot be one: `path`, or a directory above it,
    exists and is not a directory (a file, a socket, a link to one).

    Raises:
        ConfigError: naming `option` and the path that is in the way.
    """
    for candidate in (path, *path.parents):
        if candidate.exists() or candidate.is_symlink():
            if not candidate.is_dir():
                where = "" if candidate == path else f" ({candidate} is not a directory)"
                raise ConfigError(f"{option} {path}: not a directory{where}")
            return


def dump_config(cfg: RunConfig) -> str:
    """The resolved config as TOML text (round-trips through `load_config`): every key of each
    chosen kind with its value, defaults included, `harness.options` as the harness's options
    model resolved them."""
    return _to_toml(cfg.model_dump(mode="json", exclude_none=True))


def resolve_run_dir(out: Path | None, prefix: str = "") -> Path:
    if out is not None:
        return out
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{prefix}{stamp}"


def _apply_override(data: dict[str, Any], item: str) -> None:
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.key=value")
    dotted, raw = item.split("=", 1)
    keys = dotted.strip().split(".")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare word is a string
    node = data
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: {key!r} is not a section")
        node = child
    node[keys[-1]] = value


def _config_key(loc: tuple[Any, ...], data: Any) -> str:
    """The dotted config key of an error location, without the union tags pydantic inserts
    (`train.loss.cispo.tis_cap` is `train.loss.tis_cap`)."""
    parts: list[str] = []
    node = _with_default_kinds(data) if isinstance(data, dict) else data
    for part in loc:
        if isinstance(node, dict) and part not in node and node.get("kind") == part:
            continue  # the discriminated union's tag
        parts.append(str(part))
        node = node.get(part) if isinstance(node, dict) else None
    return ".".join(parts) or "<root>"


def _describe_validation(exc: ValidationError, path: Path | None, data: Any = None) -> str:
    where = f" in {path}" if path is not None else ""
    lines = []
    for err in exc.errors():
        key = _config_key(err["loc"], data)
        kind = ""
        table = key.rsplit(".", 1)[0]
        if err["type"] in ("extra_forbidden", "missing"):
            node: Any = _with_default_kinds(data) if isinstance(data, dict) else {}
            for part in table.split("."):
                node = node.get(part) if isinstance(node, dict) else None
            if isinstance(node, dict) and "kind" in node:
                kind = f" (with {table}.kind = {node['kind']!r})"
        if err["type"] == "extra_forbidden":
            lines.append(f"unknown key {key!r}{kind}{where}")
        elif err["type"] == "missing":
            lines.append(f"{key} is required{kind}{where}")
        elif err["type"] == "union_tag_invalid":
            ctx = err.get("ctx") or {}
            lines.append(f"{key}.kind = {ctx.get('tag')!r} is unknown; expected one of "
                         f"{ctx.get('expected_tags')}{where}")
        elif err["type"] == "value_error":  # a validator's own message names the keys
            lines.append(f"{err['msg'].removeprefix('Value error, ')}{where}")
        else:
            lines.append(f"{key}: {err['msg']} (got {err.get('input')!r}){where}")
    return "invalid config: " + "; ".join(lines)


def _to_toml(data: dict[str, Any]) -> str:
    scalars = {k: v for k, v in data.items() if not isinstance(v, dict)}
    tables = {k: v for k, v in data.items() if isinstance(v, dict)}
    out = [f"{k} = {_toml_value(v)}" for k, v in scalars.items()]
    for name, table in tables.items():
        out.append(f"\n[{name}]")
        for k, v in table.items():
            if isinstance(v, dict):
                out.append(f"{k} = {_toml_inline(v)}")
            else:
                out.append(f"{k} = {_toml_value(v)}")
    return "\n".join(out).lstrip("\n") + "\n"


def _toml_inline(d: dict[str, Any]) -> str:
    return "{ " + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in d.items()) + " }"


def _toml_key(k: str) -> str:
    return k if k.replace("_", "").replace("-", "").isalnum() else _toml_value(k)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return _toml_inline(v)
    raise ConfigError(f"cannot write {v!r} to TOML")
