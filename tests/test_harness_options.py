"""Harness options and needs: typed options validated at config load, per-harness defaults for
the engine context and reply cap, one-line errors naming the setting, `harnessrl harness options`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from harnessrl.config import check_run, dump_config, load_config
from harnessrl.errors import ConfigError
from harnessrl.harness.options import HARNESS_KINDS, default_limits, describe_options, requirements_for, validate_options

HARNESSRL = [sys.executable, "-m", "harnessrl.cli"]


@pytest.mark.parametrize(("kind", "context", "reply"), [
    ("mini-swe-agent", 4096, 192),
    ("white_box", 4096, 192),
    ("opencode", 16384, 512),
    ("pi", 32768, 1024),
    ("codex", 32768, 1024),
    ("claude-code", 32768, 1024),
])
def test_every_shipped_harness_gets_limits_it_works_with(kind: str, context: int, reply: int) -> None:
    cfg = load_config(None, [f"harness.kind={kind}"])
    assert (cfg.engine.max_context_tokens, cfg.sampling.max_tokens) == (context, reply)
    req = requirements_for(kind, validate_options(kind, {}))
    assert cfg.engine.max_context_tokens >= req.min_context_tokens
    assert cfg.sampling.max_tokens >= req.min_reply_tokens
    # the resolved config is explicit: a resumed run reads the same numbers back
    assert "max_context_tokens = %d" % context in dump_config(cfg)


def test_harness_needs_follow_its_options() -> None:
    cfg = load_config(None, ["harness.kind=opencode", "harness.options={context_tokens = 12000, output_tokens = 256}"])
    assert (cfg.engine.max_context_tokens, cfg.sampling.max_tokens) == (16384, 256)
    cfg = load_config(None, ["harness.kind=pi", "harness.options={api = \"anthropic-messages\", context_tokens = 6000}"])
    assert cfg.engine.max_context_tokens == 8192
    assert cfg.harness.requirements().protocol == "messages"


def test_explicit_settings_win_and_too_small_ones_name_the_fix() -> None:
    cfg = load_config(None, ["harness.kind=opencode", "engine.max_context_tokens=20000", "sampling.max_tokens=600"])
    assert (cfg.engine.max_context_tokens, cfg.sampling.max_tokens) == (20000, 600)
    with pytest.raises(ConfigError) as err:
        load_config(None, ["harness.kind=codex", "engine.max_context_tokens=4096"])
    msg = str(err.value)
    assert "\n" not in msg
    assert "harness 'codex' needs engine.max_context_tokens >= 32000 (got 4096)" in msg
    assert "--set engine.max_context_tokens=32768" in msg
    with pytest.raises(ConfigError, match=r"needs sampling.max_tokens >= 1024 \(got 192\).*--set sampling.max_tokens=1024"):
        load_config(None, ["harness.kind=claude-code", "sampling.max_tokens=192"])


def test_option_errors_name_the_key_and_list_the_valid_ones() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["harness.kind=codex", "harness.options={contxt_tokens = 9}"])
    msg = str(err.value)
    assert "unknown option 'harness.options.contxt_tokens'" in msg
    assert "valid options: context_tokens, auto_compact_tokens, extra_args" in msg
    with pytest.raises(ConfigError, match=r"unknown option 'harness.options.kill_grace_s' \(set sandbox.kill_grace_s"):
        load_config(None, ["harness.kind=opencode", "harness.options={kill_grace_s = 1}"])
    with pytest.raises(ConfigError, match=r"harness.options.max_turns: Input should be greater than or equal to 1"):
        load_config(None, ["harness.kind=white_box", "harness.options={max_turns = 0}"])
    with pytest.raises(ConfigError, match=r"harness.options.argv is required"):
        load_config(None, ["harness.kind=command"])
    with pytest.raises(ConfigError, match=r"harness.kind='nope' is unknown; expected one of mini-swe-agent"):
        load_config(None, ["harness.kind=nope"])


def test_default_limits_round_up_to_a_power_of_two() -> None:
    from harnessrl.harness.base import HarnessRequirements

    assert default_limits(HarnessRequirements("any")) == (4096, 192)
    assert default_limits(HarnessRequirements("any", 4097, 193)) == (8192, 193)
    assert default_limits(HarnessRequirements("any", 32000)) == (32768, 192)


@pytest.mark.parametrize("kind", HARNESS_KINDS)
def test_describe_options_lists_every_field_with_its_default(kind: str) -> None:
    from harnessrl.harness.options import options_model

    text = describe_options(kind)
    for name, field in options_model(kind).model_fields.items():
        assert f"  {name}: " in text
        assert field.description, f"{kind}.{name} has no description"
        assert field.description.strip().splitlines()[0].strip() in text


def test_harness_options_command_prints_options_and_needs() -> None:
    out = subprocess.run([*HARNESSRL, "harness", "options", "claude-code"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "output_tokens: int (default 1024)" in out.stdout
    assert "engine.max_context_tokens = 32768, sampling.max_tokens = 1024" in out.stdout
    bad = subprocess.run([*HARNESSRL, "harness", "options", "nope"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "expected one of" in bad.stderr


def test_check_run_names_a_bad_hook_before_anything_starts(tmp_path: Path) -> None:
    cfg = load_config(None, ["hooks.rollout_reward_fn=harnessrl.recipes.shaping:no_such_fn"])
    with pytest.raises(ConfigError, match=r"hooks.rollout_reward_fn = 'harnessrl.recipes.shaping:no_such_fn'.*no attribute"):
        check_run(cfg)
    cfg = load_config(None, ["tasks.kind=python", "tasks.source=no_such_pkg.tasks:make"])
    with pytest.raises(ConfigError, match=r"tasks.source = 'no_such_pkg.tasks:make': cannot import module 'no_such_pkg.tasks'"):
        check_run(cfg)
    cfg = load_config(None, ["tasks.verifier=missing/file.py:Verifier"])
    with pytest.raises(ConfigError, match=r"tasks.verifier = 'missing/file.py:Verifier': no file 'missing/file.py'"):
        check_run(cfg)
    check_run(load_config(None))  # the defaults import


@pytest.mark.parametrize("command", ["rollout", "train"])
def test_bad_hook_or_option_stops_the_run_before_the_model_and_makes_no_directory(tmp_path: Path, command: str) -> None:
    out_dir = tmp_path / "run"
    for bad in (["--set", "hooks.rollout_reward_fn=nope.mod:fn"],
                ["--set", "harness.kind=codex", "--set", "harness.options={bogus = 1}"]):
        res = subprocess.run([*HARNESSRL, command, "--out", str(out_dir), "--set", "engine.model=tiny-random", *bad],
                             capture_output=True, text=True, timeout=120, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
        assert res.returncode == 2, res.stderr
        assert "ConfigError" in res.stderr and ("nope.mod" in res.stderr or "bogus" in res.stderr)
        assert len(res.stderr.strip().splitlines()) == 1, res.stderr
        assert not out_dir.exists()
