"""How a run is put together: one shape for the run's sampling, mapped to the proxy by one
function; the proxy's bounds a `[proxy]` table of the run config, each one settable and
validated."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest

from harnessrl.config import load_config
from harnessrl.errors import ConfigError
from harnessrl.proxy.config import ProxyBounds, ProxyConfig
from harnessrl.runtime import proxy_config_for
from harnessrl.serve import proxy_config_for_serve

SRC = Path(__file__).resolve().parents[1] / "src" / "harnessrl"


def test_every_proxy_bound_is_a_run_config_key_and_reaches_the_proxy() -> None:
    """Each bound set in `[proxy]` arrives in the proxy of `train` / `rollout` and of `serve`."""
    bounds = ProxyBounds.model_fields
    assert len(bounds) == 20
    overrides = {name: (field.default + 1 if isinstance(field.default, int) else field.default * 2)
                 for name, field in bounds.items()}
    cfg = load_config(None, [f"proxy.{k}={v}" for k, v in overrides.items()] + ["sampling.temperature=0.7"])
    for proxy in (proxy_config_for(cfg, "m"), proxy_config_for_serve(cfg, host="127.0.0.1", port=0)):
        assert {k: getattr(proxy, k) for k in bounds} == overrides
        assert proxy.sampling is cfg.sampling and proxy.sampling.temperature == 0.7 and proxy.enforce_sampling
    assert set(ProxyConfig.model_fields) - set(bounds) == {"host", "port", "model_name", "sampling",
                                                          "enforce_sampling", "trace_path"}


def test_a_proxy_bound_out_of_range_is_refused_naming_its_key() -> None:
    with pytest.raises(ConfigError, match=r"proxy\.max_json_depth"):
        load_config(None, ["proxy.max_json_depth=500"])
    with pytest.raises(ConfigError, match=r"unknown key 'rollout\.max_model_calls'"):
        load_config(None, ["rollout.max_model_calls=3"])  # one home for it: proxy.max_model_calls
    with pytest.raises(ConfigError, match=r"sampling\.temperature must be above 0"):
        load_config(None, ["sampling.temperature=0"])


def test_one_sampling_shape_with_one_default() -> None:
    """The run config's `[sampling]` and the proxy's are the same model, with the same defaults."""
    cfg = load_config(None)
    assert type(cfg.sampling) is type(ProxyConfig().sampling)
    assert ProxyConfig().sampling.temperature == cfg.sampling.temperature == 0.4


def _calls(name: str, with_arguments: bool = False) -> list[str]:
    """The module of every call of `name` under src/harnessrl (`with_arguments`: those that pass
    any)."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                func = node.func
                called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
                if called == name and (node.args or node.keywords or not with_arguments):
                    found.append(str(path.relative_to(SRC)))
    return found


def test_one_function_maps_the_run_sampling_to_the_proxy() -> None:
    """`ProxyConfig` is given its values in one place (`proxy_config`); every command goes
    through it."""
    assert _calls("ProxyConfig", with_arguments=True) == ["proxy/config.py"]
    assert sorted(_calls("proxy_config")) == ["runtime.py", "serve.py"]


def test_the_staleness_window_is_computed_in_one_place() -> None:
    """`max_staleness + 1` is written once in code (`config.StalenessWindow.versions`); the
    orchestrator's allowance, the weight sync's kept versions and the default concurrency all
    read the window."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add)
                    and any(isinstance(side, ast.Attribute) and side.attr == "max_staleness"
                            for side in (node.left, node.right))):
                found.append(str(path.relative_to(SRC)))
    assert found == ["config.py"]
    cfg = load_config(None, ["train.max_staleness=3", "train.groups_per_step=2", "rollout.group_size=5",
                             "engine.max_batch_size=1000"])
    assert (cfg.train.window.versions, cfg.train.window.groups_ahead, cfg.concurrent_rollouts) == (4, 8, 40)


async def test_train_serve_and_rollout_parse_a_completion_the_same_way(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The chat layer is built by one function for every command, with the engine's end-of-
    sequence ids: a model whose generation config ends completions on an id the tokenizer does
    not call EOS (here "!") has it stripped under `train` and `rollout` (`start_runtime`) as under
    `serve` (`serving`)."""
    from harnessrl.engine.model_store import load_tokenizer
    from harnessrl.runtime import serving, start_runtime

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    tokenizer = load_tokenizer(model)
    bang = tokenizer.convert_tokens_to_ids("!")
    gen = json.loads((model / "generation_config.json").read_text(encoding="utf-8"))
    (model / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [2, bang]}), encoding="utf-8")
    cfg = load_config(None, [f"engine.model={json.dumps(str(model))}", "engine.num_threads=1"])
    completion = [*tokenizer.encode("hello", add_special_tokens=False), bang]
    async with start_runtime(cfg) as rt:  # `train` (train/setup.open_run) and `rollout` open this
        ran = rt.chat.parse(completion, False)
    async with serving(cfg.engine, cfg.seed, proxy_config_for_serve(cfg, host="127.0.0.1", port=0)) as served:
        served_parse = served.chat.parse(completion, False)
    assert ran == served_parse
    assert ran.content == "hello"


def test_hooks_load_once_on_the_way_to_a_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """`harnessrl train` and `rollout` load the hooks once (`config.check_run`, in
    `preflight.check_start`) and hand them on (`runtime.Prepared`); no module on the run's path
    loads them again."""
    import harnessrl.config as config_module
    from harnessrl.hooks import load_hooks
    from harnessrl.preflight import check_start

    calls: list[object] = []
    monkeypatch.setattr(config_module, "load_hooks", lambda hooks: calls.append(hooks) or load_hooks(hooks))
    cfg = load_config(None, ["tasks.kind=\"procedural\""])
    prepared = check_start(cfg, isolation="best_effort", training=True)
    assert len(calls) == 1 and prepared.tasks is not None and prepared.hooks.rollout_reward_fn is not None
    run_path = ["runtime.py", "preflight.py", "run_rollouts.py", "serve.py", *(f"train/{p.name}" for p in
                                                                              (SRC / "train").glob("*.py"))]
    assert [m for m in _calls("load_hooks") if m in run_path] == []


def test_check_training_runs_once_for_harnessrl_train() -> None:
    """`harnessrl train` checks its config once (`preflight.check_start`); `train/setup.open_run`
    checks it only when opened without that (a run opened from code)."""
    assert _calls("check_training_config") == ["preflight.py", "train/setup.py"]
    assert _calls("check_training") == ["train/setup.py"]


SECTIONS = ("engine", "sampling", "proxy", "tasks", "harness", "sandbox", "rollout", "train", "hooks", "log")
"""The tables of `RunConfig`."""


def section_reads(root: Path) -> list[str]:
    """`folder/file:line` of every read of `cfg.<section>.<key>` (a run config's key through the whole
    config, `self.cfg...` and `run.cfg...` too) in the modules under `root`."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                    and node.value.attr in SECTIONS):
                continue
            base = node.value.value
            if (isinstance(base, ast.Name) and base.id == "cfg") or (isinstance(base, ast.Attribute)
                                                                   and base.attr == "cfg"):
                found.append(f"{path.relative_to(root.parent)}:{node.lineno}")
    return found


def test_section_reads_finds_a_key_read_through_the_whole_config(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text("def f(cfg, run, t):\n    return cfg.train.steps, run.cfg.log.level, t.steps\n")
    assert [r.split(":")[-1] for r in section_reads(tmp_path)] == ["2", "2"]


LEFT_TO_SLICE = {"train/setup.py", "train/run.py", "rollout/ray_executor.py"}
"""Modules that still read the whole config (a ratchet: this set may only shrink): the training
run's assembly (`train/setup.py`, `train/run.py`) and the Ray executor's slice."""


def test_the_loop_and_the_layers_below_read_no_whole_config() -> None:
    """No module under train/, rollout/, proxy/, engine/ or sandbox/ reads `cfg.<section>.<key>`
    but those listed in `LEFT_TO_SLICE`; the loop reads its `LoopSettings`, the trainer its
    `TrainerSettings`."""
    readers = {r.split(":")[0] for folder in ("train", "rollout", "proxy", "engine", "sandbox")
               for r in section_reads(SRC / folder)}
    assert not {"train/loop.py", "train/trainer_group.py"} & readers
    assert readers <= LEFT_TO_SLICE, readers - LEFT_TO_SLICE
