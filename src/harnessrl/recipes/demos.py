"""Scripted policies for recording demonstrations (`engine.kind = "scripted"`,
`engine/scripted.py`): each reads the prompt's text as the model sees it and writes the reply a
perfect policy would, in the model's own tool format.

`lookup_bash` solves the procedural `lookup` tasks (`tasks/procedural.py`: `What is the number
in fig.txt? Write the answer to answer.txt.`) with a `bash` tool in the hermes format that
harnessrl's chat layer renders for SmolLM2 and Qwen-style templates: first
`<tool_call>{"name": "bash", "arguments": {"command": "cat fig.txt"}}</tool_call>`, then, with
the number read from the tool's result, `echo N > answer.txt`, then `N` as the final reply: two
tool calls, as a passing rollout of the RL run needs. A call without tools (an agent's title
or summary call) gets a short title. Any harness whose agent offers a `bash` tool works
(opencode, Pi, Codex CLI through their own tool names is not covered: their tool is not `bash`).
"""

from __future__ import annotations

import json
import re

_QUESTION = re.compile(r"What is the number in (\S+?)\? Write the answer to (\S+)\.")
_ASSISTANT = "<|im_start|>assistant\n"
_RESPONSE = re.compile(r"<tool_response>\s*(.*?)\s*</tool_response>", re.S)
_NUMBER = re.compile(r"-?\d+")
TITLE = "Read the file"
"""The reply to a call that offers no tools (a title request)."""


def tool_call(name: str, arguments: dict[str, str]) -> str:
    """One hermes tool call as the model writes it."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def lookup_bash(prompt: str) -> str:
    """The next reply of a perfect lookup rollout given the decoded `prompt` (module docstring).

    Raises:
        ValueError: the prompt offers tools but holds no lookup question, or the file's content
            came back without a number.
    """
    if "<tools>" not in prompt:
        return TITLE
    question = None
    for question in _QUESTION.finditer(prompt):
        pass
    if question is None:
        raise ValueError("no lookup question ('What is the number in F? Write the answer to A.') in the prompt")
    source, answer_file = question.group(1), question.group(2)
    after = prompt[question.end():]
    calls = after.count(_ASSISTANT + "<tool_call>")
    if calls == 0:
        return tool_call("bash", {"command": f"cat {source}", "description": f"Read {source}"})
    results = _RESPONSE.findall(after)
    number = _NUMBER.search(results[0]) if results else None
    if number is None:
        raise ValueError(f"no number in the result of `cat {source}`: {results[:1]!r}")
    if calls == 1:
        return tool_call("bash", {"command": f"echo {number.group()} > {answer_file}",
                                  "description": f"Write the answer to {answer_file}"})
    return number.group()
