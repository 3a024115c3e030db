"""What a model does with mini-swe-agent's prompt, before any training: the step-0 check of a recipe.

Renders the messages mini sends on its first call (the compact system and instance templates,
or ones given here, with a procedural task's instruction) through the model's chat template,
samples `--samples` replies per task from the embedded engine at each `--temperatures` value,
and counts replies that are exactly one action block (`COMPACT_ACTION_REGEX`, as mini parses
them), replies whose action is `echo ANSWER > answer.txt` with the right answer (what the
exact-match verifier would score 1; the command is matched, not run), and groups (one task's
replies) whose rewards differ, the ones that train. A recipe whose groups all score alike trains
nothing, so this is the first number to look at.

    .venv/bin/python bench/mini_prompt.py --kinds repeat --temperatures 0.4,0.7
    .venv/bin/python bench/mini_prompt.py --kinds compare --instance-file my_instance.j2
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

_ECHO = re.compile(r"echo\s+['\"]?([^'\"\s>]+)['\"]?\s*>\s*answer\.txt")


async def probe(args: argparse.Namespace) -> None:
    import jinja2

    from harnessrl.chat.layer import ChatLayer, normalize_messages
    from harnessrl.engine.embedded.engine import EmbeddedEngine
    from harnessrl.engine.model_store import load_tokenizer, resolve_model
    from harnessrl.harness.mini_swe_agent import COMPACT_ACTION_REGEX, COMPACT_INSTANCE, COMPACT_SYSTEM
    from harnessrl.tasks.procedural import ProceduralSource
    from harnessrl.types import Sampling

    system = Path(args.system_file).read_text() if args.system_file else COMPACT_SYSTEM
    instance = Path(args.instance_file).read_text() if args.instance_file else COMPACT_INSTANCE
    action = re.compile(COMPACT_ACTION_REGEX, re.DOTALL)
    model_dir = resolve_model(args.model)
    chat = ChatLayer(load_tokenizer(model_dir))
    source = ProceduralSource(kinds=args.kinds.split(","))
    engine = EmbeddedEngine(model_dir, num_threads=1, max_batch_size=max(args.samples, 1))
    try:
        for temperature in (float(t) for t in args.temperatures.split(",")):
            t0, load0 = time.monotonic(), os.getloadavg()[0]
            well_formed = correct = varied = 0
            for i in range(args.tasks):
                task = source.get(i)
                messages = [{"role": "system", "content": jinja2.Template(system).render(task=task.instruction)},
                            {"role": "user", "content": jinja2.Template(instance).render(task=task.instruction)}]
                prompt = chat.render(normalize_messages(messages))
                sampling = Sampling(temperature=temperature, max_tokens=args.max_tokens)
                completions = await asyncio.gather(*(engine.generate(prompt, sampling) for _ in range(args.samples)))
                rewards = []
                for c in completions:
                    text = chat.parse(list(c.completion_ids), False).content or ""
                    actions = action.findall(text)
                    echo = _ECHO.search(actions[0]) if len(actions) == 1 else None
                    rewards.append(int(echo is not None and echo.group(1) == task.hidden_tests["answer"]))
                    well_formed += len(actions) == 1
                    if args.show:
                        print(f"  T={temperature} answer {task.hidden_tests['answer']}: reward {rewards[-1]} "
                              f"{text[:100]!r}")
                correct += sum(rewards)
                varied += 0 < sum(rewards) < len(rewards)
            n = args.tasks * args.samples
            print(f"{args.kinds} T={temperature}: {n} replies, one action block {well_formed / n:.0%}, "
                  f"right answer {correct / n:.0%}, groups with reward variance {varied}/{args.tasks}; "
                  f"prompt {len(prompt)} tokens; {time.monotonic() - t0:.0f} s, load average "
                  f"{load0:.1f} -> {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        engine.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--kinds", default="repeat,compare", help="procedural kinds, comma-separated")
    p.add_argument("--temperatures", default="0.4")
    p.add_argument("--tasks", type=int, default=4)
    p.add_argument("--samples", type=int, default=4, help="replies per task (a group)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--system-file", help="a system template (Jinja) instead of the compact one")
    p.add_argument("--instance-file", help="an instance template (Jinja, {{task}}) instead of the compact one")
    p.add_argument("--show", action="store_true", help="print every reply")
    args = p.parse_args()
    import torch

    torch.set_num_threads(1)
    asyncio.run(probe(args))


if __name__ == "__main__":
    main()
