"""The TRL arm of `bench/learning.py`: TRL's own `GRPOTrainer` (trl 1.16.0) on the larger-number
task, run in its own venv (`--setup` makes it: `python3 -m venv`, torch, then trl) as a
subprocess of the bench. TRL's defaults except what the comparison fixes: learning rate,
completions per prompt (`num_generations`), prompts x completions per step
(`per_device_train_batch_size`), reply cap (`max_completion_length`), steps, and the CPU
(`use_cpu`; `bf16=False` unless `--bf16`, which turns on the Trainer's bfloat16 autocast),
one torch thread unless told.
Writes the final model to OUT/model and a JSON report (wall time, per-step log) to OUT/report.json.

    python bench/trl_arm.py --setup                # prints the venv's python
    VENV/bin/python bench/trl_arm.py --model DIR --out OUT --steps 51 --lr 1e-5
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

TRL_VERSION = "1.16.0"
TORCH_SPEC = "torch==2.13.0"


def venv_dir() -> Path:
    root = os.environ.get("HARNESSRL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "harnessrl")
    return Path(root) / "bench" / f"trl-{TRL_VERSION}"


def setup() -> Path:
    """Create the TRL venv once (idempotent); returns its python."""
    venv = venv_dir()
    python = venv / "bin" / "python"
    marker = venv / ".installed"
    if not marker.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", TORCH_SPEC], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", f"trl=={TRL_VERSION}"], check=True)
        marker.touch()
    return python


def train(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(Path(__file__).parent))
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    import larger_task as lt

    n_prompts = args.steps * args.prompts_per_step
    rows = [{"prompt": [{"role": "user", "content": lt.prompt(a, b)}], "answer": max(a, b)}
            for a, b in lt.pairs(lt.TRAIN_SEED, n_prompts)]
    fn = lt.REWARDS[args.reward]

    def reward(completions, answer, **_):  # noqa: ANN001
        return [fn(c[0]["content"], int(x)) for c, x in zip(completions, answer)]

    reward.__name__ = f"larger_{args.reward}"
    out = Path(args.out)
    config = GRPOConfig(
        output_dir=str(out / "trainer"), learning_rate=args.lr, lr_scheduler_type=args.lr_schedule,
        num_generations=args.completions,
        per_device_train_batch_size=args.completions * args.prompts_per_step,
        max_completion_length=args.max_tokens, max_steps=args.steps, use_cpu=True, bf16=args.bf16,
        logging_steps=1, save_strategy="no", report_to="none", seed=args.seed,
        dataloader_num_workers=0)
    trainer = GRPOTrainer(model=args.model, reward_funcs=reward, args=config,
                          train_dataset=Dataset.from_list(rows))
    t0 = time.monotonic()
    trainer.train()
    train_s = time.monotonic() - t0
    trainer.save_model(str(out / "model"))
    trainer.processing_class.save_pretrained(str(out / "model"))
    report = {"train_s": train_s, "steps": args.steps, "log": trainer.state.log_history}
    (out / "report.json").write_text(json.dumps(report, indent=1))
    print(f"trl arm: {args.steps} steps in {train_s:.0f} s", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setup", action="store_true", help="make the TRL venv and print its python")
    p.add_argument("--model")
    p.add_argument("--out")
    p.add_argument("--steps", type=int, default=51)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--lr-schedule", default="linear", choices=["linear", "cosine", "constant"],
                   help="the HF Trainer's lr_scheduler_type (TRL's default: linear)")
    p.add_argument("--prompts-per-step", type=int, default=2)
    p.add_argument("--completions", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--bf16", action="store_true", help="GRPOConfig(bf16=True): torch.autocast, float32 weights")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reward", default="lenient", choices=["lenient", "format_aware"])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.setup:
        print(setup())
        return
    train(args)


if __name__ == "__main__":
    main()
