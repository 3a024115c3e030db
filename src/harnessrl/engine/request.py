"""A generation request inside the embedded engine: what the caller asked and what it got so far.

Responsibility: the per-request state shared by the prefill scheduler (`engine/prefill.py`) and
the decode loop (`engine/embedded.py`): the prompt, the sampling parameters, where the result
goes, and the ids and logprobs sampled so far. Owned by the decode thread once queued (only
`cancelled` is set from other threads).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from harnessrl.engine.sampler import RowSampling
from harnessrl.engine.stop import StopWatcher
from harnessrl.types import Completion, Sampling

Deliver = Callable[[Completion | BaseException], None]
"""Hands the request's result (or its error) back to the caller; called once, on the decode thread."""


@dataclass(slots=True)
class Request:
    prompt_ids: tuple[int, ...]
    sampling: Sampling
    max_new_tokens: int
    deliver: Deliver
    row: RowSampling
    stop: StopWatcher | None
    cancelled: threading.Event = field(default_factory=threading.Event)
    generator: torch.Generator | None = None
    """Set at admission (from `sampling.seed`, or drawn from the engine's seed generator)."""
    policy_version: int = -1
    """The weight version at admission (what `Completion.policy_version` reports)."""
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
