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
    assert cfg.harness.kind == "white_box" and cfg.harness.options == {"max_turns": 2}
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
    assert cfg.hooks.train_turn_fn == "harnessrl.train.hooks:has_tool_call"
