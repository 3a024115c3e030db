"""The `Engine` seam: token ids in, token ids and logprobs out.

An engine never sees text or messages (the chat layer, `engine/chat.py`, renders those).
Invariant: `Completion.prompt_ids` is exactly the input it was given and
`completion_logprobs[i]` is the log-probability of `completion_ids[i]` under the
distribution it was actually drawn from (temperature, top-p, top-k applied), so a trainer
computing `log_softmax(logits / T)` on the same ids reproduces it when nothing was truncated.
`policy_version` is the weight version when the request was admitted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

from harnessrl.types import Completion, Sampling

if TYPE_CHECKING:
    import torch


@runtime_checkable
class Engine(Protocol):
    """Generates completions for prompt ids; takes new weights between decode steps."""

    @property
    def policy_version(self) -> int:
        """Version of the weights currently served."""
        ...

    @property
    def max_context_tokens(self) -> int:
        """Largest `len(prompt_ids) + max_tokens` the engine accepts."""
        ...

    async def generate(self, prompt_ids: list[int], sampling: Sampling) -> Completion:
        """Generate one completion.

        Raises:
            ContextLengthError: the prompt leaves no room for a completion.
            EngineError: the engine is stopped or failed.
        """
        ...

    def load_weights(self, state_dict: dict[str, "torch.Tensor"], version: int) -> None:
        """Swap in new weights (between decode steps) and set `policy_version = version`."""
        ...

    def close(self) -> None:
        """Stop background work; idempotent."""
        ...
