"""Validation of what a vLLM server answers to `/v1/completions` (used by `engine/vllm/client.py`).

Responsibility: turn a response (status, raw body) into (completion ids, logprobs, finish
reason) that can be trusted, or an `EngineError` naming the field that cannot.

Every fault is either an `EngineError` (the proxy records an error turn and answers the agent
503 with the reason; never trained) or, for logprob VALUES only, passed through so that
`types.check_turn_faithful` marks the turn unfaithful (the agent still gets its reply; the
tokens never train):
  * error: HTTP status != 200 (a 400 about the context length is `ContextLengthError`), a body
    that is not JSON or was cut short, a timeout (`engine/vllm/client.py`), no/empty `choices`, missing `token_ids`, an id
    that is not a non-negative int or a `"token_id:N"` string (`"token_id:0"` is id 0), a
    count of logprobs != count of ids, `usage` that disagrees with the ids, `prompt_token_ids`
    that differ from the prompt sent, more ids than `max_tokens`, a `finish_reason` other than
    `stop`/`length`.
  * unfaithful: a logprob that is `null` (read as NaN), `NaN`, `±inf`, positive or a sentinel
    below `types.MIN_SAMPLED_LOGPROB` (vLLM's `-9999.0`).

What it does not do: judge logprob values (`types.check_turn_faithful` does), or send anything.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Sequence
from typing import Any, Literal

import orjson

from harnessrl.errors import ContextLengthError, EngineError

__all__ = ["loads_body", "loads_reply", "parse_completion", "parse_token_id", "status_error"]

_TOKEN_ID_STR = re.compile(r"token_id:(\d+)\Z")
_CONTEXT_WORDS = ("maximum context length", "max_model_len", "context length", "too long")


def parse_token_id(value: Any, where: str) -> int:
    """An id as vLLM may send it: a non-negative int or `"token_id:N"` (id 0 is valid).

    Raises:
        EngineError: anything else (bools, floats, negative numbers, other strings).
    """
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and (m := _TOKEN_ID_STR.match(value)):
        return int(m.group(1))
    raise EngineError(f"{where}: {value!r} is not a token id (a non-negative int or 'token_id:N')")


def _logprob(value: Any, where: str) -> float:
    if value is None:
        return math.nan
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str) and value in ("NaN", "nan", "Infinity", "-Infinity", "inf", "-inf"):
        return float(value)
    raise EngineError(f"{where}: logprob {value!r} is not a number")


def parse_completion(body: Any, prompt_ids: Sequence[int], max_tokens: int, *,
                     where: str = "vLLM") -> tuple[list[int], list[float], Literal["stop", "length"]]:
    """Validate a `/v1/completions` response; returns (completion ids, logprobs, finish reason).

    Logprob values are returned as given (null as NaN) for `check_turn_faithful` to judge; every
    other fault raises (module docstring).

    Raises:
        EngineError: the body cannot be trusted; the message names the field.
    """
    if not isinstance(body, dict):
        raise EngineError(f"{where}: response is not a JSON object")
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices:
        raise EngineError(f"{where}: response has no choices ({'missing' if choices is None else repr(choices)[:80]})")
    choice = choices[0]
    if not isinstance(choice, dict):
        raise EngineError(f"{where}: choices[0] is {type(choice).__name__}, not an object")
    raw_ids = choice.get("token_ids")
    if not isinstance(raw_ids, list):
        raise EngineError(f"{where}: choices[0].token_ids is missing (the server must support return_token_ids)")
    if _all_ids(raw_ids):  # fast path: plain non-negative ints, as vLLM sends them
        ids = raw_ids
    else:
        ids = [parse_token_id(v, f"{where}: choices[0].token_ids[{i}]") for i, v in enumerate(raw_ids)]
    echoed = choice.get("prompt_token_ids")
    sent = prompt_ids if type(prompt_ids) is list else list(prompt_ids)
    if echoed is not None and echoed != sent:  # fast path: the ints sent, echoed as ints
        if not isinstance(echoed, list) or [parse_token_id(v, f"{where}: prompt_token_ids[{i}]")
                                            for i, v in enumerate(echoed)] != sent:
            raise EngineError(f"{where}: choices[0].prompt_token_ids differ from the prompt sent "
                              f"({len(echoed) if isinstance(echoed, list) else echoed!r} vs {len(prompt_ids)} ids)")
    lp_block = choice.get("logprobs")
    if not isinstance(lp_block, dict) or not isinstance(lp_block.get("token_logprobs"), list):
        raise EngineError(f"{where}: choices[0].logprobs.token_logprobs is missing")
    raw_lps = lp_block["token_logprobs"]
    if len(raw_lps) != len(ids):
        raise EngineError(f"{where}: {len(raw_lps)} logprobs for {len(ids)} token ids")
    if all(type(v) is float for v in raw_lps):  # fast path: JSON numbers with a fraction
        logprobs = raw_lps
    else:
        logprobs = [_logprob(v, f"{where}: choices[0].logprobs.token_logprobs[{i}]") for i, v in enumerate(raw_lps)]
    tokens = lp_block.get("tokens")
    if (isinstance(tokens, list) and tokens and isinstance(tokens[0], str) and tokens[0].startswith("token_id:")
            and tokens != [f"token_id:{i}" for i in ids]  # fast path: ids that agree
            and all(isinstance(t, str) and t.startswith("token_id:") for t in tokens)):
        as_ids = [parse_token_id(t, f"{where}: choices[0].logprobs.tokens[{i}]") for i, t in enumerate(tokens)]
        if as_ids != ids:
            raise EngineError(f"{where}: choices[0].logprobs.tokens disagree with token_ids")
    usage = body.get("usage")
    if usage is not None:
        if not isinstance(usage, dict):
            raise EngineError(f"{where}: usage is not an object")
        for key, expected in (("completion_tokens", len(ids)), ("prompt_tokens", len(prompt_ids))):
            got = usage.get(key)
            if got is not None and got != expected:
                raise EngineError(f"{where}: usage.{key}={got!r} but the response has {expected} such ids")
    if len(ids) > max_tokens:
        raise EngineError(f"{where}: {len(ids)} completion ids for max_tokens={max_tokens}")
    finish = choice.get("finish_reason")
    if finish == "stop" or finish == "length":
        return ids, logprobs, finish
    raise EngineError(f"{where}: choices[0].finish_reason={finish!r} (expected 'stop' or 'length')")


def _all_ids(values: list[Any]) -> bool:
    """Every value is a plain non-negative int (not a bool, not a `"token_id:N"` string)."""
    return all(type(v) is int for v in values) and (not values or min(values) >= 0)


_ECHO_KEY = b'"prompt_token_ids":'
_ECHO_MARK = b"echo-checked-" + os.urandom(12).hex().encode()
"""What `loads_reply` puts in place of an echo it checked (no server can guess it)."""


def loads_reply(where: str, raw: bytes, prompt_json: bytes) -> Any:
    """`loads_body` of a `/v1/completions` answer to a prompt sent as `prompt_json` (its ids'
    compact JSON), without decoding an echo equal to it: when `raw` holds
    `"prompt_token_ids":` + exactly those bytes as `choices[0]`'s echo, the echo is checked
    byte for byte and left out of the result (decoding 12k echoed ids costs ~0.2 ms, ~10x the
    byte comparison); any other answer (spaces, other ids, elsewhere) is decoded whole and
    `parse_completion` compares its echo as before.

    Raises:
        EngineError: as `loads_body`.
    """
    at = raw.find(_ECHO_KEY)
    while at >= 0 and not raw.startswith(prompt_json, at + len(_ECHO_KEY)):
        at = raw.find(_ECHO_KEY, at + 1)
    if at < 0:
        return loads_body(where, raw)
    body = loads_body(where, b"".join((raw[:at], _ECHO_KEY, b'"', _ECHO_MARK, b'"',
                                       memoryview(raw)[at + len(_ECHO_KEY) + len(prompt_json):])))
    try:
        choice = body["choices"][0]
        checked = choice.get("prompt_token_ids") == _ECHO_MARK_STR
    except (KeyError, IndexError, TypeError, AttributeError):
        checked = False
    if not checked:  # the bytes matched somewhere else: decode the answer as sent
        return loads_body(where, raw)
    del choice["prompt_token_ids"]
    return body


_ECHO_MARK_STR = _ECHO_MARK.decode()


def loads_body(where: str, raw: bytes) -> Any:
    """`raw` as JSON (NaN / Infinity accepted); raises EngineError naming `where` when it is not."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(raw)  # the stdlib also reads NaN / Infinity, which vLLM may write
    except ValueError:
        raise EngineError(f"vLLM server {where} answered a body that is not JSON: {raw[:200]!r}") from None


def status_error(url: str, status: int, raw: bytes) -> EngineError:
    """The error for a non-200 answer: `ContextLengthError` for a 400 about the context length."""
    text = raw[:600].decode("utf-8", "replace")
    if status == 400 and any(w in text.lower() for w in _CONTEXT_WORDS):
        return ContextLengthError(f"vLLM server {url}: {text}")
    return EngineError(f"vLLM server {url} answered HTTP {status}: {text}")
