"""Which engine is faster on this machine for a model: measured once, recalled at every run.

Responsibility: `compare_engines` runs the same chat prompts, N at once, greedy, through the
embedded engine and through a launched vLLM server of the same model and dtype, and returns
completion tokens per second of each (`EngineSpeed`); `record_speed` keeps the figure in
`$HARNESSRL_CACHE/engine-speed.json` (one entry per model directory; `$HARNESSRL_ENGINE_SPEED`
names another file); `engine_hint` turns the
recorded figure into the line `harnessrl doctor` and the start of `harnessrl train` print
when a run is on the embedded engine and vLLM is installed (`harnessrl engine compare`
measures it; `bench/engine.py` is the full benchmark with HF `generate` arms).

What it does not do: pick the engine for a run (a user sets `engine.kind`), or measure
anything while a run trains.

Figures: tokens/s = completion ids of all requests (up to and including EOS) / wall seconds
from the first request sent to the last completion, after one untimed warm-up request per
engine; the vLLM server's start is not timed.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

from harnessrl.chat.layer import ChatLayer
from harnessrl.chat.messages import normalize_messages
from harnessrl.engine.base import Engine
from harnessrl.engine.config import EmbeddedEngineConfig, VllmEngineConfig
from harnessrl.engine.model_store import cache_dir, load_tokenizer
from harnessrl.engine.vllm.client import make_vllm_engine
from harnessrl.engine.vllm.install import read_vllm_record
from harnessrl.errors import EngineError
from harnessrl.types import Sampling

PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about rust.",
    "List three prime numbers and explain why each is prime.",
    "def fib(n):\n    # complete this Python function",
    "Explain what a hash map is to a new programmer.",
    "How many lines does `wc -l` count in a file without a final newline?",
    "Give two ways to reverse a list in Python.",
    "What does the shell command `grep -c foo notes.txt` print?",
)
"""Chat prompts of varied lengths, cycled to the number of concurrent requests."""


@dataclass(frozen=True, slots=True)
class EngineSpeed:
    """Completion tokens per second of both engines on one model, measured on this machine."""

    model_dir: str
    dtype: str
    concurrent: int
    """Requests in flight at once."""
    max_tokens: int
    """Cap on completion ids per request."""
    embedded_tok_s: float
    vllm_tok_s: float
    embedded_threads: int
    """torch threads of the embedded engine's decode thread (`engine.num_threads`)."""
    cpus: int
    """`os.cpu_count()` when measured."""
    measured_at: str
    """UTC time of the measurement, ISO 8601."""

    @property
    def ratio(self) -> float:
        """vLLM's tokens/s over the embedded engine's (> 1: vLLM is faster)."""
        return self.vllm_tok_s / self.embedded_tok_s if self.embedded_tok_s > 0 else float("inf")


def speed_file() -> Path:
    """`$HARNESSRL_ENGINE_SPEED` if set, else `$HARNESSRL_CACHE/engine-speed.json`."""
    override = os.environ.get("HARNESSRL_ENGINE_SPEED")
    return Path(override) if override else cache_dir() / "engine-speed.json"


def record_speed(speed: EngineSpeed) -> Path:
    """Keep `speed` as the entry of its model directory (replacing an older one); returns the file."""
    path = speed_file()
    entries = _read_entries(path)
    entries[speed.model_dir] = asdict(speed)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(entries, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def recorded_speed(model_dir: Path) -> EngineSpeed | None:
    """The recorded measurement of `model_dir`, or None (none recorded, or an unreadable entry)."""
    raw = _read_entries(speed_file()).get(str(Path(model_dir).resolve()))
    if not isinstance(raw, dict):
        return None
    try:
        return EngineSpeed(**raw)
    except TypeError:  # an entry written by another version: measure again
        return None


def engine_hint(engine_kind: str, model_dir: Path, vllm_installed: bool) -> str | None:
    """The line to print at the start of a run on `engine_kind`, or None when there is nothing to say.

    On the embedded engine with vLLM installed: the recorded figure of `model_dir` when vLLM was
    faster (`set engine.kind = "vllm"`), or how to measure it when nothing is recorded. Nothing
    when vLLM is not installed, the run already uses it, or the embedded engine was faster.
    """
    if engine_kind != "embedded" or not vllm_installed:
        return None
    speed = recorded_speed(model_dir)
    if speed is None:
        return ("vLLM is installed: `harnessrl engine compare` measures whether engine.kind = \"vllm\" "
                "is faster than the embedded engine for this model on this machine")
    if speed.ratio <= 1.0:
        return None
    return (f"engine.kind = \"vllm\" decoded {speed.vllm_tok_s:.0f} tok/s against the embedded engine's "
            f"{speed.embedded_tok_s:.0f} ({speed.ratio:.1f}x) for this model at {speed.concurrent} concurrent "
            f"requests, {speed.dtype}, on this machine ({speed.measured_at[:10]}, `harnessrl engine compare`): "
            "set engine.kind = \"vllm\" to use it")


def vllm_installed() -> bool:
    """Whether `harnessrl engine install vllm` has run (its install record exists)."""
    return read_vllm_record() is not None


def compare_engines(embedded: EmbeddedEngineConfig, model_dir: Path, *, concurrent: int = 8,
                    max_tokens: int = 64, log_dir: Path | None = None) -> EngineSpeed:
    """Measure both engines on `model_dir` (blocking; about a minute with the server's start).

    The vLLM server is launched with `embedded`'s dtype and context, on CPU bound to as many cores
    as the embedded engine has torch threads (`engine.num_threads`: the same share of the machine), and stopped
    before this returns. Prompts: `PROMPTS` rendered by the model's chat template, cycled to
    `concurrent` requests; greedy, up to `max_tokens` ids each.

    Raises:
        ValueError: `concurrent` or `max_tokens` < 1.
        EngineError: vLLM is not installed (`harnessrl engine install vllm`), or an engine failed.
    """
    if concurrent < 1 or max_tokens < 1:
        raise ValueError(f"concurrent and max_tokens must be >= 1, got {concurrent} and {max_tokens}")
    if not vllm_installed():
        raise EngineError("vLLM is not installed: run `harnessrl engine install vllm` before comparing engines")
    from harnessrl.engine.embedded.engine import EmbeddedEngine  # lazy: pulls in torch

    chat = ChatLayer(load_tokenizer(model_dir))
    prompts = [chat.render(normalize_messages([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]), None)
               for i in range(concurrent)]
    sampling = Sampling(temperature=0.0, max_tokens=max_tokens)
    local = EmbeddedEngine(model_dir, dtype=embedded.dtype, device=embedded.device,
                           num_threads=embedded.num_threads, max_batch_size=max(concurrent, embedded.max_batch_size),
                           max_context_tokens=embedded.max_context_tokens, prefix_cache_tokens=0,
                           pack_weights=embedded.pack_weights)
    embedded_tok_s = _tokens_per_second(local, prompts, sampling)
    n = embedded.num_threads  # on CPU the server gets as many cores as the embedded engine had threads
    cores = (f"0-{n - 1}" if n > 1 else "0") if embedded.device == "cpu" else None
    server_cfg = VllmEngineConfig(model=embedded.model, dtype=embedded.dtype, threads=cores,
                                  max_context_tokens=embedded.max_context_tokens)
    remote = make_vllm_engine(server_cfg, model_dir, log_dir)
    vllm_tok_s = _tokens_per_second(remote, prompts, sampling)
    return EngineSpeed(
        model_dir=str(Path(model_dir).resolve()), dtype=embedded.dtype, concurrent=concurrent, max_tokens=max_tokens,
        embedded_tok_s=embedded_tok_s, vllm_tok_s=vllm_tok_s, embedded_threads=embedded.num_threads,
        cpus=os.cpu_count() or 1, measured_at=datetime.now(UTC).isoformat(timespec="seconds"),
    )


def _tokens_per_second(engine: Engine, prompts: list[list[int]], sampling: Sampling) -> float:
    """Measure on `engine`, then close it while its event loop still exists (an HTTP engine
    closes its sessions on the loop that opened them)."""
    async def run() -> float:
        await engine.generate(prompts[0][:8], sampling.model_copy(update={"max_tokens": 2}))  # warm-up, untimed
        t0 = time.perf_counter()
        done = await asyncio.gather(*(engine.generate(p, sampling, affinity=f"compare-{i}")
                                      for i, p in enumerate(prompts)))
        wall = time.perf_counter() - t0
        return sum(len(c.completion_ids) for c in done) / max(wall, 1e-9)

    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(run())
    finally:
        engine.close()
        loop.close()


def _read_entries(path: Path) -> dict[str, object]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
