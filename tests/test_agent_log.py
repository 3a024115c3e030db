"""Terminal escape sequences an agent prints never reach `run.log` raw: a real command agent in a
real sandbox, its rollout's error line written through a real log handler to `run.log`."""

from __future__ import annotations

import logging
from pathlib import Path

from fakes import FakeEngine
from harnessrl.chat.layer import ChatLayer
from harnessrl.harness.command import CommandHarness, CommandHarnessConfig
from harnessrl.proxy.config import ProxyConfig
from harnessrl.proxy.server import ProxyServer
from harnessrl.rewards.base import Reward
from harnessrl.rollout.runner import RolloutLimits, run_rollout
from harnessrl.rollout.summary import rollout_line
from harnessrl.sandbox.local import LocalSandboxBackend, SandboxConfig
from harnessrl.tasks.base import Task

# clear the screen, home the cursor, an OSC title ended by a bell, an 8-bit CSI, a DEL (the last line
# of the log is what the error quotes)
HOSTILE = "progress 10%\rprogress 99%\n\x1b[2J\x1b[H\x1b]0;pwned\x07all tests passed \x9b31m\x7f end"
AGENT = f"import sys\nsys.stdout.write({HOSTILE!r})\nsys.exit(1)\n"


class _ZeroVerifier:
    async def score(self, task: Task, sandbox: object, final_answer: str | None) -> Reward:
        return Reward(value=0.0)


def test_printable_escapes_controls_and_keeps_every_character():
    from harnessrl.harness.cli_agent import printable

    text = "tab\there\nnext " + "".join(map(chr, range(0x20))) + "\x7f\x9b é ✓"
    out = printable(text)
    assert "\t" in out and "\n" in out and not any(c in out for c in "\x1b\r\x00\x07\x7f\x9b")
    assert "\\x1b" in out and "\\x0d" in out and "\\x9b" in out and out.endswith(" é ✓")
    restored = out
    for code in [*range(0x20), 0x7F, 0x9B]:
        if chr(code) not in "\t\n":
            restored = restored.replace(f"\\x{code:02x}", chr(code))
    assert restored == text  # nothing lost


async def test_agent_escape_sequences_reach_run_log_escaped(sandbox_root: Path, tmp_path: Path, tokenizer):
    harness = CommandHarness(CommandHarnessConfig(name="script", argv=["python3", "{state_dir}/agent.py"],
                                                  files={"agent.py": AGENT}))
    backend = LocalSandboxBackend(SandboxConfig(root_dir=sandbox_root, use_bwrap=False))
    async with ProxyServer(FakeEngine(), ChatLayer(tokenizer), ProxyConfig(port=0)) as proxy:
        rollout = await run_rollout(Task("t/0", "test", "go"), 0, harness, backend, proxy,  # type: ignore[arg-type]
                                    _ZeroVerifier(), RolloutLimits(60.0, 10.0))
    assert rollout.status == "agent_error" and rollout.error is not None
    run_log = tmp_path / "run.log"
    handler = logging.FileHandler(run_log)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("harnessrl.test_agent_log")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        logger.info("rollout 1/1 %s", rollout_line(rollout, error_chars=500))
    finally:
        logger.removeHandler(handler)
        handler.close()
    written = run_log.read_bytes()
    assert not any(b in written for b in (b"\x1b", b"\r", b"\x07", b"\x7f", "\x9b".encode()))
    assert b"exited with code 1: \\x1b[2J\\x1b[H\\x1b]0;pwned\\x07all tests passed \\x9b31m\\x7f end\n" in written
