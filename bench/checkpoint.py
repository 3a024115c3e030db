"""Seconds and disk per checkpoint of SmolLM2-135M, the cost of `train.checkpoint_every_s`.

Loads the policy as `harnessrl train` does (float32, full fine-tuning, fused AdamW), takes one
optimizer step so the optimizer holds its two moments per parameter, then writes
`checkpoints/step-k` with `policy.save_checkpoint` (HF `save_pretrained` safetensors + tokenizer
+ `trainer_state.pt`) `--saves` times into a temporary directory on the run's disk. Reported per
save: wall seconds, and the directory's bytes by file. With `--lora R`: the same for rank-R
adapters (the merged weights are still written, the optimizer holds only the adapters').

Run: `.venv/bin/python bench/checkpoint.py [--saves 3] [--lora 0] [--dir DIR]`. The machine is
shared: figures are of one run under whatever load there is.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from harnessrl.engine.model_store import resolve_model
from harnessrl.train.policy import load_policy, save_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--lora", type=int, default=0)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer  # lazy: heavy

    model_dir = resolve_model("smollm2-135m")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    policy = load_policy(model_dir, learning_rate=1e-6, weight_decay=0.0, lora_rank=args.lora)
    ids = torch.tensor([tokenizer.encode("def add(a, b):\n    return a + b\n")])
    policy.model(input_ids=ids, labels=ids).loss.backward()
    policy.optimizer.step()
    params = sum(p.numel() for p in policy.model.parameters())
    print(f"SmolLM2-135M: {params / 1e6:.1f}M parameters, float32, lora_rank={args.lora}")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for k in range(1, args.saves + 1):
            directory = Path(tmp) / "checkpoints" / f"step-{k}"
            t0 = time.perf_counter()
            save_checkpoint(policy, tokenizer, directory, {"step": k, "policy_version": k})
            seconds = time.perf_counter() - t0
            sizes = {p.name: p.stat().st_size for p in directory.iterdir() if p.is_file()}
            largest = sorted(sizes.items(), key=lambda x: -x[1])[:3]
            big = ", ".join(f"{name} {size / 1e6:.0f} MB" for name, size in largest)
            print(f"save {k}: {seconds:.2f} s, {sum(sizes.values()) / 1e6:.0f} MB ({big})")


if __name__ == "__main__":
    main()
