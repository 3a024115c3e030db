"""HumanEval-style unit-test verifier: run the task's `check(candidate)` against the agent's function.

Responsibility: score a `humaneval` task (tasks/humaneval.py). Reward 1.0 when
`check(<entry_point>)` returns without raising, else 0.0; parts `passed` (same value),
`format_ok` (1.0 when a submission was found, in `solution.py` or, for text-only harnesses,
as the last fenced code block of the final answer) and `timed_out`.

The verdict is judged by a process the submission cannot read or forge (DESIGN.md §3.5,
"verifiers the submission cannot read"). In a fresh `verify-<hex>/` beside the workdir
(rewards/submission.py has the isolation rules) the verifier stages `run.py` (the judge),
`child.py` (the submission's host), the submission, a job file (the test code, the task's own
prompt, the entry point) and an empty `report` file that this process keeps open. Then
`python3 -I run.py` runs in the sandbox under `timeout_s`:
  1. the judge makes itself non-dumpable (`prctl(PR_SET_DUMPABLE, 0)`): no process without
     CAP_SYS_PTRACE can ptrace it or open its `/proc/<pid>/{mem,fd,environ}`;
  2. it opens `report` for writing and unlinks it, reads the job file and unlinks it: from
     then on the report and the hidden tests exist only in the judge (and, for the report, in
     this process's descriptor);
  3. it executes the task's prompt (so helpers such as HumanEval/32's `poly` exist) and the
     test code in its own namespace;
  4. it starts `python3 -I child.py`, writes `READY` to the report (from here on the outcome
     is the submission's), and the child (with `no_new_privs`; where the judge holds capabilities,
     uid 0 without a user namespace, with every capability set and the bounding set emptied,
     so the child has none over the judge) loads the submission and serves calls over its
     stdin/stdout; `<entry_point>` in the judge's namespace is a stub that sends each call's
     arguments to the child and returns the child's result, decoded into plain built-in values
     (None, bool, int, float, str, bytes, list, tuple, dict, set, frozenset, complex; nothing
     else crosses, so an object whose `__eq__` always holds cannot);
  5. it runs `check(<entry_point>)` itself and writes `PASS` or `FAIL <why>` to the report.
The submission's process holds no secret the verdict depends on and cannot reach the one
channel it is written to: its frames, its descriptors, `/proc`, writes to every descriptor,
monkeypatching, printing markers, exiting early (`sys.exit`, `os._exit`, a BaseException)
or killing the judge all end in 0 (`tests/test_verifiers.py`, under bubblewrap and podman).
Without bubblewrap the local sandbox isolates nothing (sandbox/local.py): the submission runs
as host root without capabilities, so it cannot read the judge, but it can reach other host
processes, as the agent itself could during its run.

The judge's wall limit is the task's `timeout_s` cut to what is left of the rollout's verify
budget (`rewards/base.verify_budget`), so a submission that sleeps ends in a judge timed out
after `READY` (0.0), before the runner's own timeout would leave the rollout unscored.

Outcomes: `PASS` → 1.0; `FAIL`, a judge killed or timed out after `READY` (an infinite loop in
the agent's code: part `timed_out`) → 0.0; no `READY` (python missing, no ctypes, the task's
test code does not run, a sandbox failure) → `Reward(value=None, error=...)`; a workspace past
the copy bounds or a full filesystem → `Reward.agent_failure` (0.0, cause recorded).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from harnessrl.errors import SandboxError, SandboxLimitError
from harnessrl.rewards.base import Reward, remaining_budget_s
from harnessrl.rewards.submission import CopyLimits, code_from_answer, read_submission, stage_verify_dir
from harnessrl.sandbox.base import Sandbox
from harnessrl.sandbox.fsread import open_root
from harnessrl.tasks.base import Task

CODEC = r'''
import json as _json

_MAX_DEPTH = 200


def encode(value, depth=0):
    """A JSON-able tagged form of a plain built-in value (bool before int; subclasses of the
    built-ins encode as their base type); TypeError for anything else."""
    if depth > _MAX_DEPTH:
        raise ValueError("value nested too deeply")
    if value is None:
        return ["n", None]
    if isinstance(value, bool):
        return ["b", bool(value)]
    if isinstance(value, int):
        return ["i", format(int(value), "x")]
    if isinstance(value, float):
        return ["f", float(value).hex()]
    if isinstance(value, complex):
        return ["c", [float(value.real).hex(), float(value.imag).hex()]]
    if isinstance(value, str):
        return ["s", str(value)]
    if isinstance(value, (bytes, bytearray)):
        return ["y", bytes(value).hex()]
    if isinstance(value, dict):
        return ["d", [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]]
    for tag, kind in (("l", list), ("t", tuple), ("S", set), ("F", frozenset)):
        if isinstance(value, kind):
            return [tag, [encode(v, depth + 1) for v in value]]
    index = getattr(type(value), "__index__", None)
    if index is not None:
        return ["i", format(index(value), "x")]
    raise TypeError("cannot pass a value of type " + type(value).__name__)


def decode(form, depth=0):
    """The plain built-in value of a tagged form; ValueError for anything malformed."""
    if depth > _MAX_DEPTH:
        raise ValueError("value nested too deeply")
    if type(form) is not list or len(form) != 2 or type(form[0]) is not str:
        raise ValueError("malformed value")
    tag, body = form
    if tag == "n" and body is None:
        return None
    if tag == "b" and type(body) is bool:
        return body
    if tag == "i" and type(body) is str:
        return int(body, 16)
    if tag == "f" and type(body) is str:
        return float.fromhex(body)
    if tag == "c" and type(body) is list and len(body) == 2 and all(type(b) is str for b in body):
        return complex(float.fromhex(body[0]), float.fromhex(body[1]))
    if tag == "s" and type(body) is str:
        return body
    if tag == "y" and type(body) is str:
        return bytes.fromhex(body)
    if type(body) is list:
        if tag == "d":
            out = {}
            for pair in body:
                if type(pair) is not list or len(pair) != 2:
                    raise ValueError("malformed dict item")
                out[decode(pair[0], depth + 1)] = decode(pair[1], depth + 1)
            return out
        kinds = {"l": list, "t": tuple, "S": set, "F": frozenset}
        if tag in kinds:
            return kinds[tag](decode(v, depth + 1) for v in body)
    raise ValueError("malformed value of tag " + repr(tag)[:20])
'''

RUNNER = CODEC + r'''

import ctypes, errno, os, subprocess, sys, traceback

MAX_REPLY_BYTES = 16 << 20


class SubmissionFailed(Exception):
    """The submission's process did not answer a call with a value."""


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _secure():
    if _libc().prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE = 4
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


def _has_capabilities():
    with open("/proc/self/status", encoding="ascii") as f:
        caps = dict(line.split(":\t", 1) for line in f if line.startswith("Cap"))
    return any(int(caps[k], 16) for k in ("CapPrm", "CapEff", "CapAmb"))


def _drop_capabilities():
    """preexec_fn (only where the judge holds capabilities: no user namespace, uid 0): empty
    the bounding set, then every set, so the child and whatever it execs hold none, and a
    non-dumpable judge stays out of its reach although both are uid 0."""
    libc = _libc()
    for cap in range(64):
        if libc.prctl(24, cap, 0, 0, 0) != 0 and ctypes.get_errno() != errno.EINVAL:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) failed")
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    if libc.capset(header, (ctypes.c_uint32 * 6)()) != 0:
        raise OSError(ctypes.get_errno(), "capset failed")
    _no_new_privileges()


def _no_new_privileges():
    if _libc().prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS: no setuid file gives it more
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")


class Child:
    """The submission's process: started here, before READY (a failure to start is the
    judge's); its first message (loaded or not) is read after READY (the submission's)."""

    def __init__(self, entry_point):
        setup = _drop_capabilities if _has_capabilities() else _no_new_privileges
        self.proc = subprocess.Popen([sys.executable, "-I", "child.py", entry_point], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True,
                                     preexec_fn=setup)

    def hello(self):
        hello = self._read()
        if hello.get("loaded") is not True:
            raise SubmissionFailed("the submission did not load: " + str(hello.get("raised"))[:300])

    def _read(self):
        line = self.proc.stdout.readline(MAX_REPLY_BYTES)
        if not line.endswith(b"\n"):
            raise SubmissionFailed("the submission's process ended or sent an oversized reply")
        try:
            reply = _json.loads(line)
        except ValueError:
            raise SubmissionFailed("the submission's process sent a malformed reply") from None
        if type(reply) is not dict:
            raise SubmissionFailed("the submission's process sent a malformed reply")
        return reply

    def call(self, args, kwargs):
        request = _json.dumps({"args": encode(list(args)), "kwargs": encode(dict(kwargs))})
        try:
            self.proc.stdin.write(request.encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise SubmissionFailed("the submission's process ended") from None
        reply = self._read()
        if "value" in reply:
            try:
                return decode(reply["value"])
            except (ValueError, TypeError, OverflowError, RecursionError) as e:
                raise SubmissionFailed("the submission returned a value that is not plain data: " + str(e)[:200])
        raise SubmissionFailed("the submission raised " + str(reply.get("raised"))[:300])

    def stop(self):
        try:
            self.proc.kill()
        except OSError:
            pass
        self.proc.wait()


def main():
    _secure()
    report = os.open("report", os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
    os.unlink("report")
    with open("job.json", encoding="utf-8") as f:
        job = _json.load(f)
    os.unlink("job.json")
    entry_point = job["entry_point"]
    namespace = {"__name__": "tests"}
    exec(compile(job["prompt"], "prompt.py", "exec"), namespace)
    exec(compile(job["test"], "tests.py", "exec"), namespace)
    check = namespace["check"]
    child = Child(entry_point)
    os.write(report, b"READY\n")
    try:
        child.hello()

        def candidate(*args, **kwargs):
            return child.call(args, kwargs)

        namespace[entry_point] = candidate
        check(candidate)
        verdict = "PASS"
    except Exception as e:
        try:
            why = (type(e).__name__ + ": " + str(e)).replace("\n", " ")[:500]
        except Exception:
            why = type(e).__name__
        verdict = "FAIL " + why
    finally:
        child.stop()
    os.write(report, verdict.encode("utf-8", "replace") + b"\n")


try:
    main()
except BaseException:
    traceback.print_exc()
    sys.exit(3)
'''

CHILD = CODEC + r'''

import os, sys


def main():
    requests = os.fdopen(os.dup(0), "rb")
    replies = os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):
        os.dup2(null, fd)

    def send(message):
        replies.write(_json.dumps(message).encode() + b"\n")
        replies.flush()

    try:
        with open("solution.py", encoding="utf-8") as f:
            source = f.read()
        namespace = {"__name__": "solution"}
        exec(compile(source, "solution.py", "exec"), namespace)
        function = namespace[sys.argv[1]]
    except BaseException as e:
        send({"raised": type(e).__name__})
        return
    send({"loaded": True})
    for line in requests:
        request = _json.loads(line)
        try:
            send({"value": encode(function(*decode(request["args"]), **decode(request["kwargs"])))})
        except BaseException as e:
            send({"raised": type(e).__name__})


main()
'''

MIN_JUDGE_S = 1.0
"""Least wall seconds the judge is given, whatever is left of the verify budget."""
READY = "READY"
PASS = "PASS"
REPORT_MAX_BYTES = 1 << 16


class UnitTestVerifier:
    """Scores `humaneval` tasks; see the module docstring for how and for the outcomes.

    Args:
        python: interpreter run inside the sandbox (looked up on the sandbox's PATH).
        solution_file: the agent's file, relative to the workdir.
        default_timeout_s: wall seconds for the test run when the task gives none.
        copy_limits: bounds of the workspace copy; past them the rollout is the agent's failure.
    """

    failure_value = 0.0

    def __init__(
        self, python: str = "python3", solution_file: str = "solution.py",
        default_timeout_s: float = 10.0, copy_limits: CopyLimits = CopyLimits(),
    ) -> None:
        self.python = python
        self.solution_file = solution_file
        self.default_timeout_s = default_timeout_s
        self.copy_limits = copy_limits

    async def score(self, task: Task, sandbox: Sandbox, final_answer: str | None) -> Reward:
        """Reward 1.0/0.0 for `check(entry_point)`; `Reward(None, error)` if the judge did not start.

        Expects `task.hidden_tests` = {"test": str, "entry_point": str, "timeout_s": float?,
        "prompt": str?}; without `prompt`, the task's own starting `solution.py` is the prompt.
        """
        source = read_submission(sandbox, self.solution_file) or code_from_answer(final_answer)
        if source is None:
            return Reward(value=0.0, parts={"passed": 0.0, "format_ok": 0.0, "timed_out": 0.0})
        tests = task.hidden_tests
        timeout_s = float(tests.get("timeout_s", self.default_timeout_s))
        left = remaining_budget_s()  # the rollout's verify budget: a judge cut by it scores 0
        timeout_s = timeout_s if left is None else max(MIN_JUDGE_S, min(timeout_s, left))
        prompt = tests.get("prompt", task.workspace.get(self.solution_file, ""))
        job = json.dumps({"test": tests["test"], "entry_point": tests["entry_point"], "prompt": prompt})
        files = {"run.py": RUNNER, "child.py": CHILD, "solution.py": source, "job.json": job, "report": ""}
        try:
            run_dir = await stage_verify_dir(sandbox, files, limits=self.copy_limits)
            report_fd = _open_report(sandbox, run_dir)
            try:
                result = await sandbox.exec([self.python, "-I", "run.py"], timeout_s, cwd=run_dir)
                report = os.pread(report_fd, REPORT_MAX_BYTES, 0).decode("utf-8", "replace")
            finally:
                os.close(report_fd)
        except SandboxLimitError as e:
            return Reward.agent_failure(f"unit-test verifier refused the workspace: {e}",
                                        parts={"passed": 0.0, "format_ok": 1.0, "timed_out": 0.0})
        except SandboxError as e:
            return Reward(value=None, error=f"unit-test verifier could not run: {e}")
        lines = report.splitlines()
        if not lines or lines[0] != READY:
            return Reward(
                value=None,
                error=f"unit-test judge did not start (returncode={result.returncode}, "
                f"timed_out={result.timed_out}): {result.stderr[-500:]}",
            )
        passed = 1.0 if lines[1:2] == [PASS] else 0.0
        parts = {"passed": passed, "format_ok": 1.0, "timed_out": float(result.timed_out)}
        return Reward(value=passed, parts=parts)


def _open_report(sandbox: Sandbox, run_dir: Path) -> int:
    """A read descriptor of `run_dir/report`, opened before the judge runs and unlinks it: after
    that, this descriptor and the judge's are its only references."""
    root = run_dir.parent
    root_fd = open_root(root)
    try:
        dir_fd = os.open(run_dir.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=root_fd)
    finally:
        os.close(root_fd)
    try:
        return os.open("report", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as e:
        raise SandboxError(f"cannot open the judge's report in {run_dir}: {e}") from None
    finally:
        os.close(dir_fd)
