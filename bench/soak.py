"""Soak: N rollouts with injected faults; nothing may leak and every row must read back.

Real parts: the proxy (`ProxyServer`, in this process), local sandboxes (bubblewrap when it
works here, `--bwrap` to choose), the command harness running a Python agent script in each
sandbox, the rollout runner, `rollouts.jsonl`. Fake part: the engine (instant, fixed ids;
it fails the calls whose prompt carries the upstream-error marker).

Each rollout gets one fault, round-robin over `FAULTS`:
  ok               calls the proxy, writes the answer
  agent_crash      calls the proxy, then dies of SIGABRT
  hang             sleeps past the agent timeout (killed at it)
  garbage          floods stdout with random bytes, writes invalid UTF-8 as its answer
  daemon_escape    double-forks a daemon that clears its environment, `cd /`, `setsid`s, and
                   closes its fds (found afterwards by a token in its argv)
  symlink_plant    links answer.txt and its own log to a host file
  upstream_error   its call reaches an engine that fails
  verifier_crash   ok agent, the verifier raises
and, with `--hostile`, three hostile agents that answer right and then hold on until killed:
  fd_hog           8 processes, each in its own session, open eventfds until refused
  cpu_hog          8 busy loops, each in its own session
  sleeper          sleeps past the agent timeout
(the honest `ok` rollouts' rewards and latency are printed to compare a run with and without
them: their bounds, `max_open_files` and the sandbox's cpu cgroup, are what keeps them apart);
and every `--cancel-every`-th step of `--step-size` rollouts is interrupted like Ctrl-C: the
rollouts still running 0.3-1.0 s into the step are cancelled.

Printed at the end: rollouts by fault and status, leaked processes (those left in the sandbox
root, plus any process anywhere whose argv holds this soak's token), leaked sandbox
directories, mounts left below the sandbox root (each command's overlays of the shared trees
live in its own mount namespace: none should be), proxy sessions still open, unreadable rows of `rollouts.jsonl`, and the RSS of
this process (which runs the proxy) before and after. The exit status is 1 when any leak or
unreadable row is found.

Usage: `.venv/bin/python bench/soak.py [--rollouts 1000] [--concurrency 4] [--bwrap auto|on|off]`.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import secrets
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psutil

FAULTS = ("ok", "agent_crash", "hang", "garbage", "daemon_escape", "symlink_plant", "upstream_error",
          "verifier_crash")
HOSTILE = ("fd_hog", "cpu_hog", "sleeper")
UPSTREAM_MARKER = "SOAK-UPSTREAM-FAIL"
SECRET = "SOAK-HOST-SECRET"

AGENT = r'''
import json, os, random, signal, sys, time, urllib.request
base_url, api_key, model, instruction_file, token = sys.argv[1:6]
task = json.load(open(instruction_file))
fault = task["fault"]

def call(text):
    body = {"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": text}]}
    req = urllib.request.Request(base_url + "/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Authorization": "Bearer " + api_key, "Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=30))

if fault == "hang":
    time.sleep(10_000)
if fault in ("fd_hog", "cpu_hog", "sleeper"):
    open("answer.txt", "w").write(task["answer"])
    for _ in range(8 if fault != "sleeper" else 0):
        if os.fork() == 0:
            os.setsid()
            held = []
            while fault == "fd_hog":
                try:
                    held.append(os.eventfd(0))
                except OSError:
                    time.sleep(10_000)
            while True:
                pass
    time.sleep(10_000)
if fault == "garbage":
    out = os.fdopen(1, "wb")
    out.write(os.urandom(200_000)); out.flush()
    open("answer.txt", "wb").write(b"\xff\xfe" + os.urandom(5000))
    sys.exit(0)
if fault == "daemon_escape":
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.chdir("/")
            for fd in range(3):
                os.close(fd)
            os.execve(sys.executable, [sys.executable, "-c", "import time; time.sleep(1000)", token], {})
        os._exit(0)
    time.sleep(0.05)
if fault == "symlink_plant":
    os.symlink(task["secret_path"], "answer.txt")
    log = os.path.join(os.environ["HOME"], ".harnessrl", "soak-agent.log")
    os.unlink(log); os.symlink(task["secret_path"], log)
    sys.exit(1)
text = task["question"] + (" " + task["marker"] if fault == "upstream_error" else "")
reply = call(text)  # an upstream error raises HTTPError: exit 1 with a traceback
if fault == "agent_crash":
    os.kill(os.getpid(), signal.SIGABRT)
open("answer.txt", "w").write(task["answer"])
print("done", reply["choices"][0]["finish_reason"])
'''


class SoakEngine:
    """Instant engine: returns fixed ids; fails calls whose prompt decodes to the marker."""

    policy_version = 0
    max_context_tokens = 65536
    eos_token_ids = (2,)

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.calls = 0

    def forget(self, affinity: str) -> None:
        return None

    async def generate(self, prompt_ids: list[int], sampling: Any, *, affinity: str | None = None,
                       cache_scope: str | None = None) -> Any:
        from harnessrl.errors import EngineError
        from harnessrl.types import Completion

        self.calls += 1
        if UPSTREAM_MARKER in self.tokenizer.decode(prompt_ids[-64:]):
            raise EngineError("soak: injected upstream failure")
        ids = tuple(range(1000, 1000 + min(7, sampling.max_tokens))) + (2,)
        ids = ids[: sampling.max_tokens]
        return Completion(tuple(prompt_ids), ids, tuple(-0.5 for _ in ids), "stop", 0)

    def load_weights(self, state_dict: dict, version: int) -> None:
        return None

    def close(self) -> None:
        return None


class CrashingVerifier:
    """Exact-answer verifier that raises for the `verifier_crash` fault."""

    def __init__(self) -> None:
        from harnessrl.rewards.exact_match import ExactMatchVerifier

        self.inner = ExactMatchVerifier()

    async def score(self, task: Any, sandbox: Any, final_answer: str | None) -> Any:
        if task.metadata["fault"] == "verifier_crash":
            raise RuntimeError("soak: injected verifier crash")
        return await self.inner.score(task, sandbox, final_answer)


def _rss_mib() -> float:
    gc.collect()
    return psutil.Process().memory_info().rss / (1 << 20)


def _token_processes(token: str) -> list[int]:
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if token in (p.info["cmdline"] or []):
                found.append(p.pid)
        except psutil.Error:
            continue
    return found


async def soak(args: argparse.Namespace) -> int:
    import json

    from harnessrl.chat.layer import ChatLayer
    from harnessrl.engine.model_store import load_tokenizer, resolve_model
    from harnessrl.harness.command import CommandHarness, CommandHarnessConfig
    from harnessrl.jsonl import read_jsonl
    from harnessrl.proxy.config import ProxyConfig, SamplingConfig
    from harnessrl.proxy.server import ProxyServer
    from harnessrl.rollout.runner import RolloutLimits, run_rollout
    from harnessrl.sandbox.layers import mount_points
    from harnessrl.sandbox.local import LocalSandboxBackend, SandboxConfig, leftover_processes, leftover_sandboxes
    from harnessrl.tasks.base import Task
    from harnessrl.types import Rollout

    work = Path(tempfile.mkdtemp(prefix="harnessrl-soak-"))
    root, out = work / "sandboxes", work / "rollouts.jsonl"
    secret_path = work / "secret.txt"
    secret_path.write_text(SECRET)
    token = f"harnessrl-soak-{secrets.token_hex(6)}"
    rng = random.Random(args.seed)
    tokenizer = load_tokenizer(resolve_model("tiny-random"))
    engine = SoakEngine(tokenizer)
    use_bwrap = {"auto": None, "on": True, "off": False}[args.bwrap]
    harness = CommandHarness(CommandHarnessConfig(
        name="soak-agent", files={"agent.py": AGENT}, final_answer_file="answer.txt",
        argv=["python3", "{state_dir}/agent.py", "{base_url}", "{api_key}", "{model}", "{state_dir}/task.json", token]))
    limits = RolloutLimits(agent_timeout_s=args.agent_timeout_s, verify_timeout_s=30)
    verifier = CrashingVerifier()
    by_fault: dict[str, Counter[str]] = {f: Counter() for f in FAULTS}
    cancelled = 0
    async with ProxyServer(engine, ChatLayer(tokenizer), ProxyConfig(model_name="soak", port=0, sampling=SamplingConfig(max_tokens=8))) as proxy:
        backend = LocalSandboxBackend(SandboxConfig(root_dir=root, use_bwrap=use_bwrap, kill_grace_s=0.3),
                                      proxy_port=proxy.port, proxy_socket=proxy.agent_socket_path)
        print(f"soak: {args.rollouts} rollouts, concurrency {args.concurrency}, bubblewrap "
              f"{'on' if backend.bwrap else 'off'}, dir {work}")
        rss_before = _rss_mib()
        sem = asyncio.Semaphore(args.concurrency)
        t0 = time.monotonic()

        faults = FAULTS + HOSTILE if args.hostile else FAULTS
        honest: list[Any] = []

        async def one(i: int, fh: Any) -> None:
            fault = faults[i % len(faults)]
            answer = str(rng.randrange(1000))
            spec = {"fault": fault, "question": f"What is {answer}?", "answer": answer, "marker": UPSTREAM_MARKER,
                    "secret_path": str(secret_path)}
            task = Task(f"soak/{i}", "procedural", json.dumps(spec),
                        hidden_tests={"answer": answer, "answer_kind": "int"}, metadata={"fault": fault})
            # the task file reaches the agent through the state dir (written by the harness)
            h = CommandHarness(harness.config.model_copy(update={"files": {**harness.config.files,
                                                                           "task.json": json.dumps(spec)}}))
            async with sem:
                rollout = await run_rollout(task, i, h, backend, proxy, verifier, limits, rollout_id=f"soak-{i}")
            by_fault.setdefault(fault, Counter())[rollout.status] += 1
            if fault == "ok":
                honest.append(rollout)
            fh.write(rollout.model_dump_json() + "\n")

        with out.open("a", encoding="utf-8") as fh:
            for start in range(0, args.rollouts, args.step_size):
                step = start // args.step_size
                tasks = [asyncio.ensure_future(one(i, fh)) for i in range(start, min(start + args.step_size, args.rollouts))]
                if args.cancel_every and step % args.cancel_every == args.cancel_every - 1:
                    await asyncio.wait(tasks, timeout=rng.uniform(0.3, 1.0))
                    for t in tasks:
                        t.cancel()  # Ctrl-C mid-step: every rollout still running is cancelled
                results = await asyncio.gather(*tasks, return_exceptions=True)
                for r in results:
                    if isinstance(r, asyncio.CancelledError):
                        cancelled += 1
                    elif isinstance(r, BaseException):
                        raise r
                fh.flush()
                done = min(start + args.step_size, args.rollouts)
                if step % 5 == 4 or done == args.rollouts:
                    print(f"  {done}/{args.rollouts} rollouts, {time.monotonic() - t0:.0f} s, "
                          f"RSS {_rss_mib():.0f} MiB", flush=True)
        elapsed = time.monotonic() - t0
        open_sessions = proxy.store.live_sessions
        rss_after = _rss_mib()
    await asyncio.sleep(0.5)  # let killed processes be reaped
    leaked_procs = sorted(set(leftover_processes(root)) | set(_token_processes(token)))
    leaked_dirs = leftover_sandboxes(root)
    leaked_mounts = [p for p in mount_points() if p.startswith(str(root.resolve()) + "/")]
    read = read_jsonl(out)
    unreadable = len(read.bad_lines)
    for row in read.rows:
        try:
            r = Rollout.model_validate(row)
            assert SECRET not in r.model_dump_json(), f"{r.rollout_id}: host secret in the rollout"
        except Exception as exc:  # noqa: BLE001 - counted, shown
            unreadable += 1
            print(f"  unreadable row {row.get('rollout_id')}: {exc}")
    print(f"\n{args.rollouts} rollouts in {elapsed:.0f} s ({len(read.rows)} finished, {cancelled} cancelled "
          f"mid-step), engine calls {engine.calls}")
    for fault, counts in by_fault.items():
        print(f"  {fault:<15} " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    if honest:
        totals = sorted(r.timings_s["total_s"] for r in honest)
        rewards = [r.reward for r in honest if r.reward is not None]
        print(f"honest (ok) rollouts:  {len(honest)}, reward mean {sum(rewards) / max(len(rewards), 1):.3f} "
              f"({len(honest) - len(rewards)} unscored), total_s p50 {totals[len(totals) // 2]:.2f} "
              f"p90 {totals[int(len(totals) * 0.9)]:.2f}")
    print(f"leaked processes:      {len(leaked_procs)} {leaked_procs[:10] if leaked_procs else ''}")
    print(f"leaked directories:    {len(leaked_dirs)}")
    print(f"leaked mounts:         {len(leaked_mounts)} {leaked_mounts[:5] if leaked_mounts else ''}")
    print(f"open proxy sessions:   {open_sessions}")
    print(f"unreadable rows:       {unreadable}")
    print(f"RSS (proxy process):   {rss_before:.0f} MiB before, {rss_after:.0f} MiB after "
          f"({rss_after - rss_before:+.0f} MiB)")
    for pid in leaked_procs:  # leave the machine clean even when the soak found a leak
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass
    failed = bool(leaked_procs or leaked_dirs or leaked_mounts or open_sessions or unreadable)
    if not failed and not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--step-size", type=int, default=16, help="rollouts per step")
    parser.add_argument("--cancel-every", type=int, default=5, help="every k-th step is cancelled mid-way (0: never)")
    parser.add_argument("--agent-timeout-s", type=float, default=2.0)
    parser.add_argument("--bwrap", choices=("auto", "on", "off"), default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="keep the soak directory")
    parser.add_argument("--hostile", action="store_true", help="also run fd_hog, cpu_hog and sleeper agents")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(1)
    raise SystemExit(asyncio.run(soak(args)))


if __name__ == "__main__":
    main()
