"""`EngineStats`: the embedded engine's counters, and the per-step metrics a training run logs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Counters of the decode thread (a snapshot)."""

    decode_steps: int
    """Batched forward passes over `[B, 1]` ids."""
    batched_steps: int
    """Decode steps that ran with B > 1."""
    max_batch_size_seen: int
    prefills: int
    generated_tokens: int
    weight_loads: int
    prefill_tokens: int
    """Prompt tokens run through the model in prefill (what the prefix cache saves on)."""
    prefix_hit_tokens: int
    """Prompt tokens whose KV came from the prefix cache instead, or from an identical prompt
    computed in the same prefill forward (`prefill_shared`)."""
    prefix_hits: int
    """Prefills that started from a cached prefix."""
    prefill_chunks: int
    """Forward passes of prefill (a prompt takes ceil(new tokens / chunk) of them)."""
    prefix_cache_tokens: int = 0
    """Token positions held in the prefix cache now."""
    prefix_cache_evictions: int = 0
    prefill_batches: int = 0
    """Prefill forwards that ran several prompts together (counted in `prefill_chunks` too)."""
    prefill_shared: int = 0
    """Prefills served by an identical prompt computed in the same forward (counted in
    `prefills`; their prompt tokens in `prefix_hit_tokens`)."""
    cancelled_requests: int = 0
    """Requests cancelled because their session ended (`EmbeddedEngine.forget`) before they
    finished."""
    busy_seconds: float = 0.0
    """Wall seconds the decode thread spent prefilling or decoding (not waiting for work):
    divided by a step's wall time it is the engine's busy fraction (`engine/busy_frac`)."""

    def step_metrics(self, previous: EngineStats | None = None, prefix: str = "engine/") -> dict[str, float]:
        """Flat metrics of the work done since `previous` (a snapshot taken earlier; None: since
        start): each counter's increase as `engine/<name>`, the gauge `engine/prefix_cache_tokens`
        as it is now, `engine/prefix_hit_frac` = reused / (reused + computed) prompt tokens and
        `engine/mean_batch_size` = generated tokens per decode step (0 when none)."""
        out: dict[str, float] = {}
        for name in EngineStats.__slots__:  # type: ignore[attr-defined]
            value = getattr(self, name)
            if name not in ("prefix_cache_tokens", "max_batch_size_seen") and previous is not None:
                value -= getattr(previous, name)
            out[prefix + name] = float(value)
        prompt = out[prefix + "prefill_tokens"] + out[prefix + "prefix_hit_tokens"]
        out[prefix + "prefix_hit_frac"] = out[prefix + "prefix_hit_tokens"] / prompt if prompt else 0.0
        steps = out[prefix + "decode_steps"]
        decoded = out[prefix + "generated_tokens"] - out[prefix + "prefills"]  # one id per prefill is not a step's
        out[prefix + "mean_batch_size"] = max(decoded, 0.0) / steps if steps else 0.0
        return out


def zero_counters() -> dict[str, int]:
    """A mutable counter dict with every `EngineStats` field at 0 (the decode thread's)."""
    return dict.fromkeys(EngineStats.__slots__, 0)  # type: ignore[attr-defined]
