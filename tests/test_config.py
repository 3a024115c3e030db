"""Run config: defaults work, TOML and overrides apply, unknown keys and bad values are named."""

from __future__ import annotations

from pathlib import Path

import pytest

from harnessrl.config import dump_config, load_config
from harnessrl.errors import ConfigError

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_defaults_are_the_cpu_recipe() -> None:
    cfg = load_config(None)
    assert cfg.engine.model == "smollm2-135m"
    assert cfg.harness.kind == "mini-swe-agent"
    assert cfg.tasks.kind == "procedural"
    assert cfg.rollout.group_size == 4


def test_overrides_parse_toml_values() -> None:
    cfg = load_config(None, ["train.learning_rate=3e-6", "harness.kind=white_box",
                             "harness.options={max_turns = 2}", "train.loss.kind=gspo", "log.report_to=[\"jsonl\"]"])
    assert cfg.train.learning_rate == 3e-6
    assert cfg.harness.kind == "white_box" and cfg.harness.options["max_turns"] == 2
    assert cfg.train.loss.kind == "gspo"


def test_unknown_key_is_named(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[train]\nlerning_rate = 1e-5\n")
    with pytest.raises(ConfigError, match=r"unknown key 'train.lerning_rate'"):
        load_config(path)


def test_bad_value_is_named() -> None:
    with pytest.raises(ConfigError, match=r"rollout.group_size"):
        load_config(None, ["rollout.group_size=0"])
    with pytest.raises(ConfigError, match=r"tasks.path is required"):
        load_config(None, ["tasks.kind=stdio"])
    with pytest.raises(ConfigError, match=r"must look like"):
        load_config(None, ["train.steps"])


def test_dump_round_trips(tmp_path: Path) -> None:
    cfg = load_config(None, ["train.steps=7", "harness.options={step_limit = 3}"])
    path = tmp_path / "resolved.toml"
    path.write_text(dump_config(cfg))
    assert load_config(path) == cfg


def test_example_configs_validate() -> None:
    cfg = load_config(EXAMPLES / "opencode_stdio.toml")
    assert cfg.harness.kind == "opencode"
    assert cfg.hooks.train_turn_fn == "harnessrl.hooks:has_tool_call"


def test_the_config_layer_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = ("import harnessrl.config, sys; harnessrl.config.load_config(None, ['train.loss.kind=cispo']); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]


@pytest.mark.parametrize(("overrides", "message"), [
    # a knob of another variant is not accepted silently
    (["train.loss.kind=cispo", "train.loss.tis_cap=3.0"], "unknown key 'train.loss.tis_cap' (with train.loss.kind = 'cispo')"),
    (["train.loss.clip_center=behaviour", "train.loss.mask_high=4"],
     "train.loss.mask_high has no effect with clip_center = 'behaviour'"),
    (["train.loss.gspo_epsilon_low=0.1"], "unknown key 'train.loss.gspo_epsilon_low' (with train.loss.kind = 'ppo_clip')"),
    (["train.loss.kind=ppo"], "train.loss.kind = 'ppo' is unknown; expected one of 'ppo_clip', 'gspo', 'cispo'"),
    (["tasks.kind=stdio", "tasks.path=t.jsonl", "tasks.difficulty=2"], "unknown key 'tasks.difficulty' (with tasks.kind = 'stdio')"),
    (["tasks.kind=python"], "tasks.source is required (with tasks.kind = 'python')"),
    (["tasks.kind=humaneval", "tasks.kwargs={a = 1}"], "unknown key 'tasks.kwargs' (with tasks.kind = 'humaneval')"),
    (["engine.kind=sglang"], "engine.kind = 'sglang' is unknown; expected one of 'embedded', 'vllm'"),
    (["engine.kind=vllm", "engine.num_threads=2"], "unknown key 'engine.num_threads' (with engine.kind = 'vllm')"),
    (["engine.kind=vllm", "engine.url='http://a:1'", "engine.urls=['http://b:1']"], "engine.url and engine.urls are exclusive"),
    (["engine.kind=vllm", "engine.url='localhost:8000'"], "engine.url='localhost:8000' must start with http://"),
    (["engine.kind=vllm", "engine.urls=['http://a:1']", "engine.replicas=2"], "engine.replicas launches servers"),
    (["engine.modle=x"], "unknown key 'engine.modle' (with engine.kind = 'embedded')"),
    (["sandbox.kind=docker"], "sandbox.kind = 'docker' is unknown; expected one of 'local'"),
    # a knob that would do nothing is refused
    (["tasks.verifier_kwargs={strict = true}"], "tasks.verifier_kwargs is set but tasks.verifier is not"),
])
def test_each_kind_accepts_only_its_own_keys(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(None, overrides)
    assert message in str(exc.value)


def test_the_saved_config_holds_the_resolved_options_of_each_kind(tmp_path: Path) -> None:
    from harnessrl.tasks.config import StdioTasks
    from harnessrl.loss.config import GspoLoss

    cfg = load_config(None, ["train.loss.kind=gspo", "tasks.kind=stdio", "tasks.path=t.jsonl"])
    assert isinstance(cfg.train.loss, GspoLoss) and cfg.train.loss.epsilon_low == 3e-4
    assert isinstance(cfg.tasks, StdioTasks)
    text = dump_config(cfg)
    assert ('loss = { kl_coef = 0.0, clip_center = "proximal", behaviour_weight = "truncate", '
            'behaviour_weight_level = "token", tis_cap = 2.0, tis_floor = 0.0, mask_low = 0.5, mask_high = 5.0, '
            'kind = "gspo", epsilon_low = 0.0003, epsilon_high = 0.0004 }') in text
    assert 'kind = "embedded"' in text and 'kind = "local"' in text and 'path = "t.jsonl"' in text
    path = tmp_path / "config.toml"
    path.write_text(text)
    assert load_config(path) == cfg
    # the harness's options too, as its options model resolved them
    text = dump_config(load_config(None, ["harness.kind=white_box", "harness.options={max_turns = 2}"]))
    assert "options = { max_turns = 2, tools = [\"bash\", \"write_file\", \"submit\"], command_timeout_s = 20.0" in text


def test_rollouts_in_flight_default_to_what_training_grants_ahead() -> None:
    """`rollout.max_concurrent_rollouts = 0` resolves to `(max_staleness + 1) x groups_per_step x
    group_size`, capped at the embedded engine's decode batch; a set value is kept as it is."""
    assert load_config(None, []).concurrent_rollouts == 3 * 1 * 4
    assert load_config(None, ["train.groups_per_step=2"]).concurrent_rollouts == 16, "capped at max_batch_size 16"
    assert load_config(None, ["train.groups_per_step=2", "engine.max_batch_size=32"]).concurrent_rollouts == 24
    assert load_config(None, ["train.max_staleness=0"]).concurrent_rollouts == 4
    assert load_config(None, ["rollout.max_concurrent_rollouts=5"]).concurrent_rollouts == 5
    vllm = load_config(None, ['engine.kind="vllm"', 'engine.url="http://127.0.0.1:9"', "train.groups_per_step=4"])
    assert vllm.concurrent_rollouts == 3 * 4 * 4, "no embedded decode batch to cap at"
