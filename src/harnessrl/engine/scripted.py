"""A scripted policy behind the `Engine` seam: demonstrations recorded through a real agent.

Responsibility: answer each call with the reply a Python function writes for the prompt, as the
model's own ids (the reply text encoded by the model's tokenizer, then EOS), so that an agent
driven through the real proxy records demonstrations whose prompts are token for token what
that agent sends (`engine.kind = "scripted"`, `harnessrl sft` trains on them). The policy reads
the prompt as the model would see it (its ids decoded, chat template and tool schemas included)
and writes the reply in the model's own format (for SmolLM2 through harnessrl's chat layer, a
hermes `<tool_call>` block); `recipes/demos.py` has one for the lookup tasks.

Every reply id gets logprob 0.0 (the policy is deterministic: probability 1), so the turns are
faithful (`types.check_turn_faithful`). `policy_version` stays 0: these turns are
demonstrations, not samples of the policy being trained.

What it does not do: sample, batch or hold weights (`load_weights` is refused by the weight
sync seam: a scripted run does not train).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from harnessrl.errors import ContextLengthError, EngineError
from harnessrl.types import Completion, Sampling

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ScriptedPolicy = Callable[[str], str]
"""(the prompt's text, decoded from its ids) -> the reply's text (without EOS)."""


class ScriptedEngine:
    """Answers every call with `policy(decoded prompt)` encoded by `tokenizer`, then EOS.

    Args:
        tokenizer: the model's tokenizer (a transformers tokenizer: `decode`, `encode`,
            `eos_token_id`).
        policy: the scripted policy (`ScriptedPolicy`).
        max_context_tokens: largest prompt + reply length served.

    Raises:
        EngineError: the tokenizer has no EOS id.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, policy: ScriptedPolicy, max_context_tokens: int) -> None:
        eos = tokenizer.eos_token_id
        if eos is None:
            raise EngineError("the scripted engine needs a tokenizer with an EOS id")
        self._tokenizer = tokenizer
        self._policy = policy
        self._eos = int(eos)
        self._max_context_tokens = max_context_tokens
        self.calls = 0
        """Calls answered so far."""

    @property
    def policy_version(self) -> int:
        return 0

    @property
    def max_context_tokens(self) -> int:
        return self._max_context_tokens

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (self._eos,)

    def stats(self) -> None:
        return None

    async def generate(self, prompt_ids: list[int], sampling: Sampling, *,
                       affinity: str | None = None, cache_scope: str | None = None) -> Completion:
        """The policy's reply to the decoded prompt, as ids, then EOS; cut to
        `sampling.max_tokens` (finish_reason `length`) when longer.

        Raises:
            ContextLengthError: `len(prompt_ids) >= max_context_tokens`.
            EngineError: the policy raised (its message kept).
        """
        if len(prompt_ids) >= self._max_context_tokens:
            raise ContextLengthError(f"prompt of {len(prompt_ids)} tokens >= max_context_tokens="
                                     f"{self._max_context_tokens}")
        decoded = self._tokenizer.decode(prompt_ids)
        text = decoded if isinstance(decoded, str) else "".join(decoded)
        try:
            reply = self._policy(text)
        except Exception as exc:  # noqa: BLE001 - the call fails, the run goes on
            raise EngineError(f"the scripted policy raised {type(exc).__name__}: {exc}") from exc
        ids = [*self._tokenizer.encode(reply, add_special_tokens=False), self._eos]
        self.calls += 1
        cut = len(ids) > sampling.max_tokens
        ids = ids[: sampling.max_tokens]
        return Completion(prompt_ids=tuple(prompt_ids), completion_ids=tuple(ids),
                          completion_logprobs=(0.0,) * len(ids), finish_reason="length" if cut else "stop",
                          policy_version=0)

    def forget(self, affinity: str) -> None:
        """Nothing is queued: every call is answered at once."""

    def close(self) -> None:
        """Nothing to stop."""
