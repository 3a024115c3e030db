"""mini-swe-agent model classes that call the run's proxy over plain HTTP instead of through litellm.

Shipped into the sandbox by the mini-swe-agent harness (`model_client = "direct"`, its default)
as `harnessrl_mini_client.py` and imported there by mini, whose `model.model_class` takes an
import path. harnessrl never imports it: `minisweagent` lives in the agent's own venv.

Why: every rollout is a new `mini` process, and `import litellm` costs it ~2.9 CPU-s (openai's
pydantic types, litellm's integrations; `python -c "import litellm"` in the agent's venv: 3.4 s
wall, 3.1 s user), against ~0.3 s for mini's CLI with these classes. In `make train` the agents'
start-up took most of the machine (the bound line: other processes 69% of 2 cores); with these
classes 21%, and the job took 2 min 22-42 s instead of 6 min 3 s (`docs/benchmarks.md`). litellm
adds nothing here: the endpoint is always the proxy, an OpenAI chat-completions server.

What differs from mini's litellm classes is the transport only, done the way mini's own
OpenRouter classes do it (`requests`, the same error classes). The messages, the action
parsing and format errors, the observations, the retries (`minisweagent.models.utils.retry`)
and the trajectory are mini's code: `ProxyTextbasedModel` is `OpenRouterTextbasedModel` and
`ProxyToolCallModel` `OpenRouterModel` with the URL and key of the run's endpoint. The body is
`{"model", "messages"}` (plus mini's `bash` tool with tool calls) and `model_kwargs` after
`api_base`, `api_key`, `timeout` and litellm's `drop_params` are taken out of them; OpenRouter's
`usage` field is not sent (the proxy refuses fields it does not know).
"""

from __future__ import annotations

import json

import requests
from minisweagent.models.openrouter_model import (
    OpenRouterAPIError,
    OpenRouterAuthenticationError,
    OpenRouterModel,
    OpenRouterModelConfig,
    OpenRouterRateLimitError,
)
from minisweagent.models.openrouter_textbased_model import OpenRouterTextbasedModel
from minisweagent.models.utils.actions_toolcall import BASH_TOOL

DEFAULT_TIMEOUT_S = 600.0
"""Seconds a call may take (litellm's default request timeout); `model_kwargs.timeout` sets it."""


def _use_endpoint(model: OpenRouterModel) -> None:
    """Take the endpoint out of `model.config.model_kwargs` and aim the model at it."""
    kwargs = dict(model.config.model_kwargs)
    base = kwargs.pop("api_base", None)
    if not isinstance(base, str) or not base:
        raise ValueError("model.model_kwargs.api_base (the proxy's base URL) is not set")
    model._api_url = base.rstrip("/") + "/chat/completions"
    model._api_key = str(kwargs.pop("api_key", ""))
    model._timeout = float(kwargs.pop("timeout", DEFAULT_TIMEOUT_S))
    kwargs.pop("drop_params", None)  # litellm's own option, not a request field
    model.config.model_kwargs = kwargs


def _post(model: OpenRouterModel, payload: dict[str, object]) -> dict[str, object]:
    """POST `payload` to the endpoint; the reply as a dict, or mini's OpenRouter errors."""
    headers = {"Authorization": f"Bearer {model._api_key}", "Content-Type": "application/json"}
    try:
        response = requests.post(model._api_url, headers=headers, data=json.dumps(payload), timeout=model._timeout)
    except requests.exceptions.RequestException as e:
        raise OpenRouterAPIError(f"Request failed: {e}") from e
    if response.status_code == 401:
        raise OpenRouterAuthenticationError(f"HTTP 401: {response.text}")
    if response.status_code == 429:
        raise OpenRouterRateLimitError(f"HTTP 429: {response.text}")
    if response.status_code >= 400:
        raise OpenRouterAPIError(f"HTTP {response.status_code}: {response.text}")
    return response.json()


class _AtProxy:
    """The endpoint and the transport, before mini's model class in the bases; `tools`: what
    the body carries besides the messages."""

    tools: tuple[dict[str, object], ...] = ()
    config: OpenRouterModelConfig  # set by mini's class

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        _use_endpoint(self)

    def _query(self, messages: list[dict[str, str]], **kwargs: object) -> dict[str, object]:
        body: dict[str, object] = {"model": self.config.model_name, "messages": messages}
        if self.tools:
            body["tools"] = list(self.tools)
        return _post(self, {**body, **(self.config.model_kwargs | kwargs)})


class ProxyTextbasedModel(_AtProxy, OpenRouterTextbasedModel):
    """mini's text protocol (actions in fenced blocks), no tools."""


class ProxyToolCallModel(_AtProxy, OpenRouterModel):
    """mini's tool-call protocol: one `bash` tool."""

    tools = (BASH_TOOL,)
