"""Memory of one training step plus its weight sync: peak RSS, the update measured from itself
against the earlier weight copies.

Each configuration runs in its own process: the policy (fp32, AdamW) and an embedded engine on
the same model, one warm-up step (optimizer state allocated), then the measured step and sync.
Peak RSS (`ru_maxrss`) is read before and after the measured step; the growth is what the step
and sync added over the process's earlier peak.

  * `update` (the loop now): `optimizer_step` (its `param_delta_l2` is recomputed from AdamW's
    update) and `InProcessWeightSync.publish`.
  * `kl` (`train.loss.kl_coef > 0`, full fine-tuning): as `update`, with the frozen reference
    copy of the initial weights loaded and its logprobs computed per micro-batch; the peak
    before the step already holds the copy (`peak_before_mb` against `update`'s).
  * `copies` (the loop before): a full clone of the weights kept from the last sync, then after
    the step the exported weights, their L2 distance to the kept clone, and a fresh clone for
    the next step (taken while the old one is still alive).

Usage: `.venv/bin/python bench/step_memory.py [--model smollm2-135m] [--tokens 256]
[--modes copies,update,kl]`.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import resource
import time


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _run(model: str, mode: str, tokens: int, out: "mp.Queue[dict]") -> None:
    import torch

    torch.set_num_threads(1)
    from harnessrl.engine.embedded.engine import EmbeddedEngine
    from harnessrl.engine.model_store import resolve_model
    from harnessrl.engine.weight_sync import InProcessWeightSync
    from harnessrl.loss.losses import loss_fn_for
    from harnessrl.train.policy import export_weights, load_policy
    from harnessrl.train.step import optimizer_step
    from harnessrl.types import Row

    model_dir = resolve_model(model)
    policy = load_policy(model_dir, learning_rate=1e-5, weight_decay=0.0, lora_rank=0, reference=mode == "kl")
    ids = tuple(range(100, 100 + tokens))
    half = tokens // 2
    mask = tuple([0] * half + [1] * (tokens - half))
    lps = tuple([0.0] * half + [-2.0] * (tokens - half))
    vers = tuple([-1] * half + [0] * (tokens - half))
    rows = [Row(ids, mask, lps, vers, "r0", 0, 1.0), Row(ids[::-1], mask, lps, vers, "r1", 0, -1.0)]

    from functools import partial

    from harnessrl.loss.config import PpoClipLoss
    from harnessrl.train.policy import reference_logprobs

    kl = mode == "kl"
    loss_fn = loss_fn_for(PpoClipLoss(kl_coef=0.1 if kl else 0.0))
    reference = partial(reference_logprobs, policy, temperature=1.0) if kl else None

    def step() -> dict:
        return optimizer_step(policy.model, policy.optimizer, rows, loss_fn, temperature=1.0,
                              token_budget=2 * tokens, max_grad_norm=1.0, reference=reference).metrics

    with EmbeddedEngine(model_dir, num_threads=1) as engine:
        sync = InProcessWeightSync(engine)
        step()
        last_synced = export_weights(policy, copy=True) if mode == "copies" else None
        before = _peak_mb()
        t0 = time.perf_counter()
        metrics = step()
        if mode in ("update", "kl"):
            sync.publish(policy, 1)
            delta = metrics["param_delta_l2"]
        else:
            weights = export_weights(policy)
            engine.load_weights(weights, 1)
            delta = math.sqrt(sum(float(torch.sum((weights[k] - last_synced[k]) ** 2)) for k in weights))
            last_synced = export_weights(policy, copy=True)
        seconds = time.perf_counter() - t0
        after = _peak_mb()
    n_params = sum(p.numel() for p in policy.model.parameters())
    out.put({"mode": mode, "model": model, "params_M": n_params / 1e6, "peak_before_mb": round(before),
             "peak_after_mb": round(after), "step_growth_mb": round(after - before),
             "param_delta_l2": delta, "step_and_sync_s": round(seconds, 2)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--modes", default="copies,update,kl")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    results = []
    for mode in args.modes.split(","):
        queue: mp.Queue[dict] = ctx.Queue()
        proc = ctx.Process(target=_run, args=(args.model, mode, args.tokens, queue))
        proc.start()
        results.append(queue.get())
        proc.join()
    for r in results:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
