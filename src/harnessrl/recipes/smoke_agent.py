"""A one-call agent for the command harness, for pipeline tests and benchmarks.

`one_call_agent(max_tokens, timeout_s)` is the text of a Python program (stdlib only) that
makes one chat-completions call through the proxy, writes the reply's text to `answer.txt` in
its working directory, then sleeps. It takes four arguments: the base URL, the API key, the
model and the seconds to sleep, so a command harness runs it with

    argv = ["python3", "{state_dir}/agent.py", "{base_url}", "{api_key}", "{model}", "<sleep_s>"]
    files = { "agent.py" = <one_call_agent(...)> }
    final_answer_file = "answer.txt"

The sleep stands for an agent's work in its sandbox (a node busy with a rollout, a process to
kill). The program holds no `{name}` braces, since the command harness templates file contents.
It says nothing about a task: for tests and benchmarks only.
"""

from __future__ import annotations

__all__ = ["one_call_agent"]

_TEMPLATE = """
import json, sys, time, urllib.request
base, key, model, sleep_s = sys.argv[1:5]
body = json.dumps(dict(model=model, max_tokens=MAX_TOKENS, messages=[dict(role="user", content="Say hi.")]))
req = urllib.request.Request(base + "/chat/completions", data=body.encode(),
                             headers=dict(Authorization="Bearer " + key))
req.add_header("Content-Type", "application/json")
with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
    reply = json.load(resp)
open("answer.txt", "w").write(reply["choices"][0]["message"]["content"] or "")
time.sleep(float(sleep_s))
"""


def one_call_agent(max_tokens: int, timeout_s: float) -> str:
    """The agent program's source: one call asking for at most `max_tokens` tokens, waiting at
    most `timeout_s` seconds for the reply (see the module docstring for its arguments).

    Raises ValueError when `max_tokens` < 1 or `timeout_s` <= 0."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens!r} must be an int >= 1")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s!r} must be > 0")
    return _TEMPLATE.replace("MAX_TOKENS", str(max_tokens)).replace("TIMEOUT_S", repr(float(timeout_s)))
