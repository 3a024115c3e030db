"""Host-side code never follows a path the agent controls (DESIGN.md §10, sandbox/fsread.py).

Attacks run from inside real local sandboxes, with bubblewrap and without: a shell in the
sandbox plants symlinks (the whole `work` dir, `answer.txt`, the agent's log, each CLI
harness's answer/trajectory file, `home` itself) pointing at host files and directories the
test made outside the sandbox. Then the host side (verifiers, harness readers, a whole
`run_rollout` with the command harness) runs, and the test checks: the secret is nowhere in
the reward, the rollout or its trace; nothing was written outside the sandbox; the sandbox
directory is gone after `close()`.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import pytest

from harnessrl.errors import SandboxError
from harnessrl.harness import claude_code, codex, mini_swe_agent, opencode, pi
from harnessrl.harness.cli_agent import AgentPaths, CliAgentHarness, collect_result, read_log_tail
from harnessrl.harness.command import CommandHarness, CommandHarnessConfig
from harnessrl.rewards.exact_match import ExactMatchVerifier
from harnessrl.rewards.stdio_tests import StdioVerifier
from harnessrl.rewards.unit_tests import UnitTestVerifier
from harnessrl.rollout.runner import RolloutLimits, run_rollout
from harnessrl.sandbox.bwrap import bwrap_path
from harnessrl.sandbox.fsread import (
    UnsafePathError,
    copy_tree_beneath,
    make_private_dir,
    open_root,
    read_beneath,
    read_text_or_none,
)
from harnessrl.sandbox.local import LocalSandbox, LocalSandboxBackend, SandboxConfig
from harnessrl.tasks.base import Task
from harnessrl.types import Endpoint, Trace

SECRET = "HOST-SECRET-7f3a9c"
BWRAP = [False, pytest.param(True, marks=pytest.mark.skipif(bwrap_path() is None, reason="no bwrap"))]


# ---- fsread on plain directories -------------------------------------------------------------


def _tree(tmp_path: Path) -> tuple[Path, Path]:
    root = tmp_path / "root"
    (root / "work" / "sub").mkdir(parents=True)
    (root / "work" / "sub" / "f.txt").write_text("inside")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text(SECRET)
    return root, outside


def test_read_beneath_reads_regular_files_bounded(tmp_path: Path) -> None:
    root, _ = _tree(tmp_path)
    assert read_beneath(root, "work/sub/f.txt") == b"inside"
    assert read_beneath(root, "work/sub/f.txt", 3) == b"ins"
    assert read_beneath(root, "work/sub/f.txt", 3, tail=True) == b"ide"
    with pytest.raises(FileNotFoundError):
        read_beneath(root, "work/missing.txt")
    with pytest.raises(ValueError, match="max_bytes"):
        read_beneath(root, "work/sub/f.txt", -1)


@pytest.mark.parametrize("planted", ["work", "work/sub", "work/sub/f.txt"])
def test_a_symlink_at_any_component_is_not_followed(tmp_path: Path, planted: str) -> None:
    root, outside = _tree(tmp_path)
    # `outside` mirrors what each link would lead to: outside/sub/f.txt and outside/f.txt
    (outside / "sub").mkdir()
    (outside / "sub" / "f.txt").write_text(SECRET)
    (outside / "f.txt").write_text(SECRET)
    target = root / planted
    if target.is_dir():
        os.rename(target, target.with_name(target.name + ".orig"))
        target.symlink_to(outside)
    else:
        target.unlink()
        target.symlink_to(outside / "secret.txt")
    assert (root / "work/sub/f.txt").read_text() == SECRET, "the link would lead to the secret"
    with pytest.raises(UnsafePathError):
        read_beneath(root, "work/sub/f.txt")
    assert read_text_or_none(root, "work/sub/f.txt") is None


@pytest.mark.parametrize("rel", ["../outside/secret.txt", "work/../../outside/secret.txt", "/etc/passwd", ""])
def test_paths_leaving_the_root_are_refused(tmp_path: Path, rel: str) -> None:
    root, _ = _tree(tmp_path)
    with pytest.raises(UnsafePathError, match="relative"):
        read_beneath(root, rel)


def test_special_files_are_refused_without_blocking(tmp_path: Path) -> None:
    root, _ = _tree(tmp_path)
    os.mkfifo(root / "work" / "pipe")
    with pytest.raises(UnsafePathError, match="regular"):
        read_beneath(root, "work/pipe")  # a plain open() of a FIFO would block forever
    with pytest.raises(UnsafePathError, match="regular"):
        read_beneath(root, "work/sub")


def test_copy_tree_skips_links_and_special_files_and_is_bounded(tmp_path: Path) -> None:
    root, outside = _tree(tmp_path)
    work = root / "work"
    (work / "a.py").write_text("a" * 10)
    (work / "link.txt").symlink_to(outside / "secret.txt")
    (work / "dirlink").symlink_to(outside)
    os.mkfifo(work / "pipe")
    (work / "big.bin").write_bytes(b"x" * 1000)
    (work / "keep.txt").write_text("agent's version")
    dst, dst_fd = make_private_dir(root, "verify-")
    root_fd = open_root(root)
    src_fd = os.open("work", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=root_fd)
    try:
        (dst / "keep.txt").write_text("verifier's version")
        report = copy_tree_beneath(src_fd, dst_fd, max_bytes=100)
    finally:
        for fd in (dst_fd, root_fd, src_fd):
            os.close(fd)
    assert (dst / "a.py").read_text() == "a" * 10
    assert (dst / "sub" / "f.txt").read_text() == "inside"
    assert (dst / "keep.txt").read_text() == "verifier's version"
    assert report.skipped == {"big.bin": "size bound", "dirlink": "symlink", "keep.txt": "exists",
                              "link.txt": "symlink", "pipe": "special file"}
    assert report.truncated and report.files == 2 and report.bytes == 16
    assert not any(p.is_symlink() for p in dst.rglob("*"))
    assert sorted(os.listdir(outside)) == ["secret.txt"]


# ---- attacks from inside real sandboxes ------------------------------------------------------


async def _sandbox(root: Path, use_bwrap: bool, workspace: dict[str, str] | None = None) -> LocalSandbox:
    backend = LocalSandboxBackend(SandboxConfig(root_dir=root, use_bwrap=use_bwrap, kill_grace_s=0.2))
    return await backend.create("attack", workspace or {"README.md": "task\n"})


async def _plant(sandbox: LocalSandbox, script: str) -> None:
    """Run `script` as the agent would: a shell inside the sandbox, cwd = workdir."""
    result = await sandbox.exec(script, 30)
    assert result.returncode == 0, result.stderr


def _outside(tmp_path: Path) -> Path:
    outside = tmp_path / "outside"
    (outside / "dir").mkdir(parents=True)
    (outside / "secret.txt").write_text(SECRET)
    return outside


def _listing(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@pytest.mark.parametrize("use_bwrap", BWRAP)
@pytest.mark.parametrize("verifier_kind", ["unit", "stdio"])
async def test_symlinked_work_dir_does_not_redirect_hidden_tests(
    tmp_path: Path, sandbox_root: Path, use_bwrap: bool, verifier_kind: str
) -> None:
    outside = _outside(tmp_path)
    (outside / "dir" / "solution.py").write_text("def f():\n    return 1\nprint(1)\n")
    before = _listing(outside)
    sandbox = await _sandbox(sandbox_root, use_bwrap, {"solution.py": "def f():\n    return 0\n"})
    try:
        # the agent replaces its workdir with a link to a host directory (absolute host path:
        # dangling inside bubblewrap, followed by any host-side code that trusts it)
        await _plant(sandbox, f"cd .. && mv work work.orig && ln -s {shlex.quote(str(outside / 'dir'))} work")
        if verifier_kind == "unit":
            task = Task("t/0", "humaneval", "", hidden_tests={
                "test": "HIDDEN_MARKER = 1\ndef check(c):\n    assert c() == 1\n", "entry_point": "f"})
            reward = await UnitTestVerifier().score(task, sandbox, None)
            assert (reward.value, reward.parts["format_ok"]) == (0.0, 0.0), reward
        else:
            task = Task("t/0", "stdio", "", hidden_tests={"inputs": ["HIDDEN_INPUT\n"], "outputs": ["1"]})
            reward = await StdioVerifier().score(task, sandbox, None)
            assert (reward.value, reward.parts["format_ok"]) == (0.0, 0.0), reward
        assert _listing(outside) == before, "the verifier wrote outside the sandbox"
        assert not list(outside.rglob("*HIDDEN*")) and "HIDDEN" not in "".join(
            p.read_text() for p in outside.rglob("*") if p.is_file())
    finally:
        await sandbox.close()
    assert _listing(outside) == before


@pytest.mark.parametrize("use_bwrap", BWRAP)
async def test_verify_dir_is_fresh_and_beside_the_workdir(sandbox_root: Path, use_bwrap: bool) -> None:
    sandbox = await _sandbox(sandbox_root, use_bwrap, {"solution.py": "def f():\n    return 1\n"})
    try:
        # pre-made links with likely names do not matter: the directory name is random, mkdir'd
        await _plant(sandbox, "ln -s /tmp ../verify-0000000000000000 && mkfifo fifo && ln -s /etc/passwd pw")
        task = Task("t/0", "humaneval", "", hidden_tests={
            "test": "def check(c):\n    assert c() == 1\n", "entry_point": "f"})
        reward = await UnitTestVerifier().score(task, sandbox, None)
        assert reward.value == 1.0, reward
        made = [p for p in sandbox.root.iterdir() if p.name.startswith("verify-") and not p.is_symlink()]
        assert len(made) == 1
        names = sorted(os.listdir(made[0]))
        # the job (hidden tests) and the report were unlinked by the judge; links, fifo skipped
        assert names == ["child.py", "run.py", "solution.py"], names
    finally:
        await sandbox.close()


@pytest.mark.parametrize("use_bwrap", BWRAP)
async def test_symlinked_answer_file_is_not_read(tmp_path: Path, sandbox_root: Path, use_bwrap: bool) -> None:
    outside = _outside(tmp_path)
    (outside / "answer").write_text("42")
    sandbox = await _sandbox(sandbox_root, use_bwrap)
    try:
        await _plant(sandbox, f"ln -s {shlex.quote(str(outside / 'answer'))} answer.txt")
        task = Task("t/0", "procedural", "", hidden_tests={"answer": "42", "answer_kind": "int"})
        reward = await ExactMatchVerifier().score(task, sandbox, None)
        assert reward.value == 0.0 and reward.parts["format_ok"] == 0.0
    finally:
        await sandbox.close()


class _Sessions:
    """A session host without a proxy (the command agent below never calls a model)."""

    def open_session(self, rollout_id: str, group: str | None = None) -> tuple[str, str]:
        return rollout_id, "key"

    def endpoint(self, key: str) -> Endpoint:
        return Endpoint(base_url="http://127.0.0.1:9/v1", api_key=key, model="m")

    def close_session(self, session_id: str) -> Trace:
        return Trace(session_id=session_id, rollout_id=session_id)


class _Backend:
    def __init__(self, root: Path, use_bwrap: bool) -> None:
        self.inner = LocalSandboxBackend(SandboxConfig(root_dir=root, use_bwrap=use_bwrap, kill_grace_s=0.2))
        self.created: list[LocalSandbox] = []

    async def create(self, rollout_id: str, workspace: dict[str, str]) -> LocalSandbox:
        sandbox = await self.inner.create(rollout_id, workspace)
        self.created.append(sandbox)
        return sandbox


@pytest.mark.parametrize("use_bwrap", BWRAP)
async def test_rollout_of_an_agent_planting_links_holds_no_host_file(
    tmp_path: Path, sandbox_root: Path, use_bwrap: bool
) -> None:
    """The agent links its answer file and its own log to a host secret and exits 1 (so the
    log tail and the final answer both go into the rollout): neither is followed."""
    outside = _outside(tmp_path)
    secret = shlex.quote(str(outside / "secret.txt"))
    script = (f"ln -s {secret} answer.txt; rm -f \"$HOME/.harnessrl/linker.log\"; "
              f"ln -s {secret} \"$HOME/.harnessrl/linker.log\"; exit 1")
    harness = CommandHarness(CommandHarnessConfig(name="linker", argv=["bash", "-c", script],
                                                  final_answer_file="answer.txt"))
    backend = _Backend(sandbox_root, use_bwrap)
    task = Task("t/0", "procedural", "x", hidden_tests={"answer": SECRET, "answer_kind": "str"})
    rollout = await run_rollout(task, 0, harness, backend, _Sessions(), ExactMatchVerifier(),
                                RolloutLimits(agent_timeout_s=30, verify_timeout_s=30))
    assert rollout.status == "agent_error", rollout.error
    assert rollout.reward == 0.0 and rollout.final_answer is None
    assert "not read" in rollout.metadata["log_tail"]
    assert SECRET not in rollout.model_dump_json()
    assert sorted(os.listdir(outside)) == ["dir", "secret.txt"]
    assert not backend.created[0].root.exists()


def _plant_links_script(state: Path, names: list[str], secret: Path) -> str:
    return " && ".join(f"rm -f {shlex.quote(str(state / n))} && ln -s {shlex.quote(str(secret))} "
                       f"{shlex.quote(str(state / n))}" for n in names)


CLI_HARNESSES = [opencode.OpencodeHarness(), pi.PiHarness(), claude_code.ClaudeCodeHarness(), codex.CodexHarness(),
                 mini_swe_agent.MiniSweAgentHarness()]


@pytest.mark.parametrize("use_bwrap", BWRAP)
async def test_each_cli_harness_reader_ignores_planted_links(
    tmp_path: Path, sandbox_root: Path, use_bwrap: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each CLI harness's spec read back through the shared runner (`collect_result`) after the
    agent replaced its log and its answer/trajectory file with links to host files that would
    pass as its answer: the answer is None and the secret is nowhere in the result."""
    monkeypatch.setattr(CliAgentHarness, "executable", lambda self: "/bin/true")
    outside = _outside(tmp_path)
    lure = outside / "lure.jsonl"
    lure.write_text(
        "\n".join([
            '{"type": "text", "part": {"text": "%s"}}' % SECRET,
            '{"message": {"role": "assistant", "content": [{"type": "text", "text": "%s"}]}}' % SECRET,
            '{"type": "result", "result": "%s"}' % SECRET,
        ]) + "\n")
    traj = outside / "traj.json"
    traj.write_text('{"info": {"submission": "%s", "exit_status": "Submitted"}}' % SECRET)
    sandbox = await _sandbox(sandbox_root, use_bwrap)
    endpoint = Endpoint(base_url="http://127.0.0.1:9/v1", api_key="k", model="m")
    try:
        home = sandbox.home
        for h in CLI_HARNESSES:
            sandbox.write_file(f".harnessrl/{h.name}.log", "ordinary log line\n", base="home")
        script = " && ".join([
            _plant_links_script(home / ".harnessrl", [f"{h.name}.log" for h in CLI_HARNESSES], lure),
            "mkdir -p $HOME/.harnessrl/mini-swe-agent $HOME/.harnessrl/codex",
            _plant_links_script(home / ".harnessrl/mini-swe-agent", ["traj.json"], traj),
            _plant_links_script(home / ".harnessrl/codex", ["last_message.txt"], outside / "secret.txt"),
        ])
        await _plant(sandbox, script)
        assert all(SECRET in (home / f".harnessrl/{h.name}.log").read_text() for h in CLI_HARNESSES)
        for h in CLI_HARNESSES:
            paths = AgentPaths(sandbox, h.name)
            spec = h.spec(Task("t/0", "test", "x"), endpoint, paths)
            result = collect_result(sandbox, spec, paths, 1, False, h.name)
            assert result.final_answer is None, h.name
            assert SECRET not in repr(result), h.name
            assert "not read" in result.log_tail and result.error is not None, h.name
    finally:
        await sandbox.close()


@pytest.mark.parametrize("use_bwrap", BWRAP)
async def test_a_symlinked_home_is_not_followed(
    tmp_path: Path, sandbox_root: Path, use_bwrap: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    outside = _outside(tmp_path)
    (outside / "dir" / ".harnessrl").mkdir()
    (outside / "dir" / ".harnessrl" / "pi.log").write_text(
        '{"message": {"role": "assistant", "content": [{"type": "text", "text": "%s"}]}}\n' % SECRET)
    sandbox = await _sandbox(sandbox_root, use_bwrap)
    try:
        sandbox.write_file(".harnessrl/pi.log", "real log\n", base="home")
        await _plant(sandbox, f"cd .. && mv home home.orig && ln -s {shlex.quote(str(outside / 'dir'))} home")
        assert SECRET in (sandbox.home / ".harnessrl/pi.log").read_text(), "the plant did not work"
        monkeypatch.setattr(CliAgentHarness, "executable", lambda self: "/bin/true")
        paths = AgentPaths(sandbox, "pi")
        spec = pi.PiHarness().spec(Task("t/0", "test", "x"), Endpoint("http://127.0.0.1:9/v1", "k", "m"), paths)
        result = collect_result(sandbox, spec, paths, 0, False, "pi")
        assert result.final_answer is None and SECRET not in repr(result)
        assert "not read" in read_log_tail(sandbox, paths)
        with pytest.raises(SandboxError, match="symlink"):
            sandbox.read_file(".harnessrl/pi.log", base="home")
        with pytest.raises(SandboxError, match="symlink"):
            sandbox.write_file(".harnessrl/pi.log", "x", base="home")
    finally:
        await sandbox.close()
    assert (outside / "dir" / ".harnessrl" / "pi.log").read_text().startswith('{"message"')


@pytest.mark.parametrize("use_bwrap", BWRAP)
async def test_sandbox_file_api_follows_no_link(tmp_path: Path, sandbox_root: Path, use_bwrap: bool) -> None:
    """`Sandbox.write_file` / `read_file` (the white-box loop's write_file tool, workspace set-up)
    after the agent swapped `work` for a link to a host directory: nothing read or written there."""
    outside = _outside(tmp_path)
    before = _listing(outside)
    sandbox = await _sandbox(sandbox_root, use_bwrap, {"a/b.txt": "x"})
    try:
        sandbox.write_file("a/c.txt", "fine")
        assert sandbox.read_file("a/c.txt") == b"fine"
        await _plant(sandbox, "ln -s /etc/hostname a/host && ln -s ../a a/loop")
        with pytest.raises(SandboxError, match="symlink"):
            sandbox.read_file("a/host")
        with pytest.raises(SandboxError, match="symlink"):
            sandbox.write_file("a/loop/x.txt", "no")
        with pytest.raises(SandboxError, match=r"\.\."):
            sandbox.write_file("../home/x.txt", "no")
        await _plant(sandbox, f"cd .. && mv work work.orig && ln -s {shlex.quote(str(outside))} work")
        with pytest.raises(SandboxError, match="symlink"):
            sandbox.write_file("dir/evil.txt", "planted")
        with pytest.raises(SandboxError, match="symlink"):
            sandbox.read_file("secret.txt")
    finally:
        await sandbox.close()
    assert _listing(outside) == before
