"""The tool-calling warm start of `bench/learning.py --task lookup`: a short supervised fine-tune of
the bench's model on demonstrations of the lookup task, the start of both arms.

SmolLM2-135M-Instruct writes no `<tool_call>` for the lookup prompts, so without a start that
calls tools neither arm earns a reward and the side-by-side compares nothing. The demonstrations
are tasks of harnessrl's procedural `lookup` family at seed offset `DEMO_OFFSET` (2,000,000),
disjoint from the bench's training tasks (offset 0) and its held-out ones (1,000,000). Each is the
whole episode a perfect rollout would be: the task's system and user messages, the assistant's
hermes call `<tool_call>\\n{"name": "bash", "arguments": {"command": "cat FILE"}}\\n</tool_call>`,
the tool's result as `lookup_env.run_bash` returns it (`exit code 0\\nN\\n`), and the answer `N`.

Each demonstration is tokenised as the arm that would meet it feeds it to the model, alternately
(even demos harnessrl's, odd TRL's), so the start favours neither rendering:
  * harnessrl (`harnessrl_ids`): the white-box loop's prompts through harnessrl's chat layer
    (SmolLM2's template, the `bash` tool described in the system message), each turn's prompt the
    previous prompt + the reply's ids + the rest of the re-rendered conversation (bridged
    rendering);
  * TRL (`trl_arm.py --render-lookup-demos`, run in the TRL venv): TRL's own code, its prompt
    rendering with `LookupEnv.bash` as the tool under the Qwen2.5 template the TRL arm uses, and
    its `_get_tool_suffix_ids` for the tool result.
A reply's ids are its text's ids under SmolLM2's tokenizer, then EOS (`<|im_end|>`), in both.

The loss is on the replies' ids only. The start is meant to teach the format, not the task: the
final answer's ids are in the loss for a fraction `answer_frac` of the demos (the others train
only the call), and training is one short pass, so the start calls `bash` on the held-out tasks
but answers right only on part of them, and RL has room to move the pass rate. The defaults (32
demos, one pass of 4 steps of 8 at lr 1e-4, the answer trained in 2 of the 32) were chosen by
measuring the start (2-core EPYC, load ~5, bfloat16 autocast, ~250 s): greedy held-out pass
65.6% of 32 tasks with a `bash` call first on all 32, 44% of 32 training tasks at temperature 1.0;
the failures write a made-up `<tool_response>` block instead of the number. With the answer
trained in 4 of 32 demos the start is already at 100% greedy (53% sampled), in 16 of 32 at 100%
(81%), in none at 0% sampled (every final reply a made-up block): the call is learnt in 4 steps
(loss 1.05 -> 0.01), the answer from a handful of examples. `Config` holds every setting; the checkpoint is built once per config under
`~/.cache/harnessrl/bench/warmstart-<hash>/` (the hash of the config and the base model's
weights file size and name) and reused, deterministic given `seed` (one torch thread, seeded data
order and initialisation).

    .venv/bin/python bench/tool_warmstart.py                 # build (or find) it, print its path
    .venv/bin/python bench/tool_warmstart.py --eval 32       # + its held-out pass and tool-call rate
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import lookup_env as le  # noqa: E402

DEMO_OFFSET = 2_000_000
"""Seed offset of the demonstrations: disjoint from training (0) and held-out (1,000,000)."""
VERSION = 1
"""Bumped when the demonstrations' or the training's meaning changes (part of the hash)."""


@dataclasses.dataclass(frozen=True)
class Config:
    n_demos: int = 32
    epochs: int = 1
    lr: float = 1e-4
    batch_size: int = 8
    answer_frac: float = 0.0625
    """Fraction of the demos whose final answer is in the loss (the rest train only the call)."""
    seed: int = 0
    renderings: str = "both"
    """'both' (alternate harnessrl's and TRL's tokenisation) or 'harnessrl' (no TRL venv needed)."""
    autocast: str = "off"
    """'bfloat16': the forward and backward under bfloat16 autocast, float32 weights (`default_config`
    picks it on a CPU with native bfloat16)."""


def default_config(**overrides: Any) -> Config:
    """The bench's warm start: `Config`'s defaults, bfloat16 autocast where the CPU has native
    bfloat16 (`harnessrl.train.step.native_cpu_bfloat16`; ~10x slower emulated), and `overrides`."""
    from harnessrl.train.step import native_cpu_bfloat16

    return Config(**{"autocast": "bfloat16" if native_cpu_bfloat16() else "off", **overrides})


def demos(n: int, offset: int = DEMO_OFFSET) -> list[dict[str, Any]]:
    """The first `n` demonstrations: {"prompt": [system, user], "replies": [call, answer],
    "tool_results": [result], "task_id"}; the tool result is the real one (`cat` run on the
    task's workspace by `lookup_env.run_bash`)."""
    src = le.source("lookup", 1, offset)
    out = []
    for k in range(n):
        task = src.get(k)
        stem = task.metadata["question"].split("the number in ")[1].rstrip("?")
        command = f"cat {stem}"
        with tempfile.TemporaryDirectory(prefix="lookup-demo-") as tmp:
            for rel, text in task.workspace.items():
                (Path(tmp) / rel).write_text(text)
            result = le.run_bash(command, Path(tmp))
        call = "<tool_call>\n" + json.dumps({"name": "bash", "arguments": {"command": command}}) + "\n</tool_call>"
        out.append({"prompt": [{"role": "system", "content": task.system_prompt},
                               {"role": "user", "content": task.instruction}],
                    "replies": [call, task.hidden_tests["answer"]], "tool_results": [result],
                    "task_id": task.task_id})
    return out


def harnessrl_ids(demo: dict[str, Any], chat: Any) -> tuple[list[int], list[int]]:
    """(ids, mask) of `demo` as harnessrl's white-box loop feeds it to the model (module
    docstring); mask 1 on the replies' ids."""
    from harnessrl.chat.layer import normalize_messages
    from harnessrl.harness.python_loop import _TOOL_SPECS

    tools = [_TOOL_SPECS["bash"]]
    messages = list(demo["prompt"])
    ids = chat.render(normalize_messages(messages), tools)
    mask = [0] * len(ids)
    eos = chat.tokenizer.eos_token_id
    for i, reply in enumerate(demo["replies"]):
        reply_ids = chat.tokenizer.encode(reply, add_special_tokens=False) + [eos]
        ids, mask = ids + reply_ids, mask + [1] * len(reply_ids)
        if i < len(demo["tool_results"]):
            call = json.loads(reply.split("<tool_call>\n", 1)[1].split("\n</tool_call>", 1)[0])
            messages += [{"role": "assistant", "content": "", "tool_calls": [
                {"id": f"c{i}", "type": "function",
                 "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}}]},
                {"role": "tool", "tool_call_id": f"c{i}", "content": demo["tool_results"][i]}]
            full = chat.render(normalize_messages(messages), tools)
            if full[:len(ids)] != ids:
                raise ValueError("the re-rendered conversation does not extend the previous prompt + reply")
            ids, mask = full, mask + [0] * (len(full) - len(ids))
    return ids, mask


def trl_ids(demo_list: list[dict[str, Any]], model_dir: Path) -> list[tuple[list[int], list[int]]]:
    """(ids, mask) of each demo as TRL's tool loop feeds it to the model, computed by TRL's own
    code in the TRL venv (`trl_arm.py --render-lookup-demos`)."""
    import trl_arm

    python = trl_arm.setup()
    with tempfile.TemporaryDirectory(prefix="lookup-demos-") as tmp:
        src, dst = Path(tmp) / "demos.json", Path(tmp) / "ids.json"
        src.write_text(json.dumps(demo_list))
        subprocess.run([str(python), str(BENCH / "trl_arm.py"), "--model", str(model_dir), "--task", "lookup",
                        "--render-lookup-demos", str(src), str(dst)], check=True, capture_output=True,
                       env={**os.environ, "HF_HUB_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1"})
        return [(d["ids"], d["mask"]) for d in json.loads(dst.read_text())]


def examples(cfg: Config, model_dir: Path) -> list[tuple[list[int], list[int]]]:
    """The training examples (ids, loss mask): demo k in harnessrl's rendering when k is even or
    `renderings` is 'harnessrl', else TRL's; the answer's ids leave the loss for the demos past
    the first `answer_frac` of a seeded shuffle."""
    from harnessrl.chat.layer import ChatLayer
    from harnessrl.engine.model_store import load_tokenizer

    demo_list = demos(cfg.n_demos)
    chat = ChatLayer(load_tokenizer(model_dir))
    out = [harnessrl_ids(d, chat) for d in demo_list]
    if cfg.renderings == "both":
        odd = trl_ids(demo_list[1::2], model_dir)
        out[1::2] = odd
    order = list(range(len(out)))
    random.Random(f"warmstart-answers:{cfg.seed}").shuffle(order)
    no_answer = set(order[round(cfg.answer_frac * len(out)):])
    eos = chat.tokenizer.eos_token_id
    for k in no_answer:
        ids, mask = out[k]
        answer_len = len(chat.tokenizer.encode(demo_list[k]["replies"][-1], add_special_tokens=False)) + 1
        assert ids[-1] == eos and all(mask[-answer_len:])
        out[k] = (ids, mask[:-answer_len] + [0] * answer_len)
    return out


def config_hash(cfg: Config, model_dir: Path) -> str:
    weights = sorted((p.name, p.stat().st_size) for p in model_dir.glob("*.safetensors"))
    blob = json.dumps({"v": VERSION, "cfg": dataclasses.asdict(cfg), "model": model_dir.name, "weights": weights},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def cache_root() -> Path:
    root = os.environ.get("HARNESSRL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "harnessrl")
    return Path(root) / "bench"


def train(cfg: Config, model_dir: Path, out: Path, threads: int = 1) -> dict[str, Any]:
    """Fine-tune the model in `model_dir` on `examples(cfg)` with harnessrl's warm start
    (`harnessrl.train.sft.fine_tune`: AdamW, constant lr, loss the mean over the batch's reply
    tokens, `cfg.autocast`) and save it, with the base model's tokenizer files, to `out`."""
    import torch

    from harnessrl.train.sft import SftSettings, fine_tune

    torch.set_num_threads(threads)
    settings = SftSettings(lr=cfg.lr, epochs=cfg.epochs, batch_size=cfg.batch_size, seed=cfg.seed,
                           autocast=cfg.autocast)
    return fine_tune(model_dir, examples(cfg, model_dir), out, settings,
                     meta={"config": dataclasses.asdict(cfg)}, meta_file="warmstart.json")


def warm_start(model_dir: Path, cfg: Config | None = None, threads: int = 1) -> Path:
    """The warm-start checkpoint of `cfg` over `model_dir`: built on the first call, then reused."""
    cfg = cfg or default_config()
    out = cache_root() / f"warmstart-{config_hash(cfg, model_dir)}"
    if not (out / "warmstart.json").exists():
        print(f"tool warm start: building {out} ({cfg})", flush=True)
        meta = train(cfg, model_dir, out, threads)
        print(f"tool warm start: {meta['steps']} steps in {meta['train_s']:.0f} s, loss {meta['first_loss']:.3f} "
              f"-> {meta['last_loss']:.3f}", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    for f in dataclasses.fields(Config):
        p.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--eval", type=int, default=0, metavar="N", help="then score it on N held-out tasks "
                   "(bench/learning.py's held-out evaluation, --max-turns 3, --max-tokens 48)")
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(args.threads)
    from harnessrl.engine.model_store import resolve_model

    cfg = default_config(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Config)
                            if getattr(args, f.name) != f.default})
    path = warm_start(resolve_model(args.model), cfg, args.threads)
    print(path)
    if args.eval:
        import asyncio

        import learning

        bench_args = learning.parse_args(["--task", "lookup", "--eval-prompts", str(args.eval)])
        print(json.dumps(asyncio.run(learning.held_out_lookup(path, bench_args, threads=args.threads))))


if __name__ == "__main__":
    main()
