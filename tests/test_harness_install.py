"""Agent installs: idempotent second run, exact install hint when missing, `make_harness`."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from harnessrl.errors import ConfigError, HarnessInstallError
from harnessrl.harness import install as install_mod
from harnessrl.harness.command import CommandHarness, render_template
from harnessrl.harness.install import (
    AGENTS,
    InstallRecord,
    agent_dir,
    agent_executable,
    install_agent,
    read_install_record,
)
from harnessrl.harness.mini_swe_agent import MiniSweAgentHarness
from harnessrl.harness.opencode import OpencodeHarness
from harnessrl.harness.select import make_harness


def _fake_install(cache: Path, name: str, version: str) -> Path:
    """A complete-looking install record whose executable exists (no pip or npm run)."""
    spec = AGENTS[name]
    exe = cache / "agents" / name / spec.executable
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    record = InstallRecord(name=name, package=spec.package, version=version, executable=str(exe), installed_at=0.0)
    (cache / "agents" / name / "installed.json").write_text(record.model_dump_json())
    return exe


def test_missing_agent_raises_with_exact_install_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HARNESSRL_CACHE", str(tmp_path))
    with pytest.raises(HarnessInstallError, match="run: harnessrl harness install opencode$"):
        agent_executable("opencode")
    assert agent_dir("opencode") == tmp_path / "agents" / "opencode"


def test_second_install_is_a_fast_noop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HARNESSRL_CACHE", str(tmp_path))
    exe = _fake_install(tmp_path, "mini-swe-agent", AGENTS["mini-swe-agent"].version)

    def no_subprocess(*args: object, **kwargs: object) -> str:
        raise AssertionError(f"an installed agent must not run {args!r}")

    monkeypatch.setattr(install_mod, "run_step", no_subprocess)
    t0 = time.monotonic()
    outcome = install_agent("mini-swe-agent", log=lambda line: None)
    assert outcome.already_installed and outcome.record.executable == str(exe)
    assert time.monotonic() - t0 < 0.5
    # the CLI says where it is and exits 0
    from harnessrl.harness.cli import install

    app = typer.Typer()
    app.command()(install)
    result = CliRunner().invoke(app, ["mini-swe-agent"])
    assert result.exit_code == 0
    assert f"mini-swe-agent {AGENTS['mini-swe-agent'].version} already installed: {exe}" in result.output


def test_other_version_or_missing_executable_is_not_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HARNESSRL_CACHE", str(tmp_path))
    exe = _fake_install(tmp_path, "opencode", "0.0.1")
    assert read_install_record("opencode") is None  # pinned version differs
    (tmp_path / "agents/opencode/installed.json").write_text(
        InstallRecord(name="opencode", package="opencode-ai", version=AGENTS["opencode"].version,
                      executable=str(exe), installed_at=0.0).model_dump_json()
    )
    assert read_install_record("opencode") is not None
    exe.unlink()
    assert read_install_record("opencode") is None  # half-removed install


def test_unknown_agent_names_known_ones() -> None:
    with pytest.raises(HarnessInstallError, match="'aider'.*mini-swe-agent, opencode"):
        install_agent("aider")


@pytest.mark.agents
def test_installed_agents_reinstall_is_noop() -> None:
    """On a machine where `harnessrl harness install` ran, a second install does nothing."""
    for name in ("mini-swe-agent", "opencode"):
        if read_install_record(name) is None:
            pytest.skip(f"{name} not installed here (run: harnessrl harness install {name})")
        outcome = install_agent(name, log=lambda line: None)
        assert outcome.already_installed and outcome.duration_s < 0.5
        assert Path(outcome.record.executable).is_file()


def test_make_harness_builds_each_kind_with_validated_options() -> None:
    mini = make_harness("mini-swe-agent", {"tool_calls": True, "step_limit": 7})
    assert isinstance(mini, MiniSweAgentHarness) and mini.config.step_limit == 7 and mini.config.tool_calls
    oc = make_harness("opencode", {"output_tokens": 64})
    assert isinstance(oc, OpencodeHarness) and oc.config.output_tokens == 64
    cmd = make_harness("command", {"argv": ["my-agent", "{instruction}"], "name": "mine"})
    assert isinstance(cmd, CommandHarness) and cmd.name == "mine"
    with pytest.raises(ConfigError, match=r"harness\.options\.step_limit"):
        make_harness("mini-swe-agent", {"step_limit": 0})
    with pytest.raises(ConfigError, match=r"harness\.options\.bogus"):
        make_harness("opencode", {"bogus": 1})
    with pytest.raises(ConfigError, match="harness.kind='nope'"):
        make_harness("nope", {})


def test_render_template_single_pass_leaves_other_braces() -> None:
    values = {k: f"<{k}>" for k in ("base_url", "keyed_base_url", "api_key", "model", "instruction",
                                     "instruction_file", "workdir", "home", "state_dir")}
    values["instruction"] = "use {api_key}"
    assert render_template('{"k": "{api_key}", "i": "{instruction}", "x": {other}}', values) == (
        '{"k": "<api_key>", "i": "use {api_key}", "x": {other}}'
    )
