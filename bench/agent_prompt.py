"""What a model does with mini-swe-agent's multi-turn prompt before any training: the step-0
check of a multi-turn recipe, without starting the agent.

Plays mini-swe-agent's text loop in process, the way mini does it: the system and instance
templates (`--templates multiturn` by default, or files), one reply per call from the embedded
engine (cut at the request's stop strings, `--stop`), the reply's action parsed with the
compact action regex, run with bash in a fresh directory holding the task's workspace files,
its output sent back through the observation template, for `--turns` calls; a reply without
exactly one action gets a one-line format error instead. Then `answer.txt` is scored by the
exact-match verifier's rules. Per temperature it prints the rollouts that looked first (their
first action names a workspace file), that passed, the mean calls before the passing answer
was written, groups with reward variance (the ones that train), and the time. A real agent
adds its start-up (~10-15 s for mini under load) and nothing the model sees.

    .venv/bin/python bench/agent_prompt.py --kinds lookup --temperatures 0.4,0.7 --show
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from harnessrl.harness.mini_swe_agent import MULTITURN_FORMAT_ERROR as FORMAT_ERROR  # noqa: E402


def _run(action: str, workdir: Path) -> tuple[str, int]:
    try:
        out = subprocess.run(["bash", "-c", action], cwd=workdir, capture_output=True, text=True, timeout=10,
                             stdin=subprocess.DEVNULL)
        return out.stdout + out.stderr, out.returncode
    except subprocess.TimeoutExpired:
        return "timeout", 124


async def probe(args: argparse.Namespace) -> None:
    import jinja2

    from harnessrl.chat.layer import ChatLayer, normalize_messages
    from harnessrl.engine.embedded.engine import EmbeddedEngine
    from harnessrl.engine.model_store import load_tokenizer, resolve_model
    from harnessrl.harness import mini_swe_agent as mini
    from harnessrl.rewards.exact_match import parse_answer
    from harnessrl.tasks.procedural import ProceduralSource
    from harnessrl.types import Sampling

    prefix = args.templates.upper()
    system = Path(args.system_file).read_text() if args.system_file else getattr(mini, f"{prefix}_SYSTEM")
    instance = Path(args.instance_file).read_text() if args.instance_file else getattr(mini, f"{prefix}_INSTANCE")
    observation = jinja2.Template(Path(args.observation_file).read_text() if args.observation_file
                                  else mini.MULTITURN_OBSERVATION)
    action_re = re.compile(mini.COMPACT_ACTION_REGEX, re.DOTALL)
    stop = tuple(s for s in args.stop.split("|") if s)
    model_dir = resolve_model(args.model)
    chat = ChatLayer(load_tokenizer(model_dir))
    source = ProceduralSource(kinds=args.kinds.split(","), difficulty=args.difficulty,
                              seed_offset=args.seed_offset)
    engine = EmbeddedEngine(model_dir, num_threads=1, max_batch_size=max(args.samples, 1))
    try:
        for temperature in (float(t) for t in args.temperatures.split(",")):
            t0, load0 = time.monotonic(), os.getloadavg()[0]
            looked = passed = varied = 0
            pass_calls: list[int] = []
            sampling = Sampling(temperature=temperature, max_tokens=args.max_tokens, stop=stop)
            for i in range(args.tasks):
                task = source.get(i)
                dirs = [tempfile.TemporaryDirectory() for _ in range(args.samples)]
                for d in dirs:
                    for name, text in task.workspace.items():
                        (Path(d.name) / name).write_text(text)
                convs = [[{"role": "system", "content": jinja2.Template(system).render(task=task.instruction)},
                          {"role": "user", "content": jinja2.Template(instance).render(task=task.instruction)}]
                         for _ in range(args.samples)]
                answered_at: list[int | None] = [None] * args.samples
                first: list[str] = [""] * args.samples
                for call in range(args.turns):
                    prompts = [chat.render(normalize_messages(c)) for c in convs]
                    completions = await asyncio.gather(*(engine.generate(p, sampling) for p in prompts))
                    for s, c in enumerate(completions):
                        text = chat.parse(list(c.completion_ids), False, stop=stop).content or ""
                        convs[s].append({"role": "assistant", "content": text})
                        actions = action_re.findall(text)
                        if len(actions) == 1:
                            out, rc = _run(actions[0].strip(), Path(dirs[s].name))
                            msg = observation.render(output={"output": out, "returncode": rc, "exception_info": ""})
                            if call == 0:
                                first[s] = actions[0]
                        else:
                            msg = FORMAT_ERROR
                        convs[s].append({"role": "user", "content": msg})
                        answer_file = Path(dirs[s].name) / "answer.txt"
                        got = parse_answer(answer_file.read_text(), "int") if answer_file.exists() else None
                        if got == task.hidden_tests["answer"] and answered_at[s] is None:
                            answered_at[s] = call + 1
                        elif got != task.hidden_tests["answer"]:
                            answered_at[s] = None
                rewards = [int(a is not None) for a in answered_at]
                looked += sum(any(name in f for name in task.workspace) for f in first)
                passed += sum(rewards)
                pass_calls += [a for a in answered_at if a is not None]
                varied += 0 < sum(rewards) < len(rewards)
                if args.show:
                    for s in range(args.samples):
                        replies = [m["content"][:70] for m in convs[s][2::2]]
                        print(f"  T={temperature} {task.metadata['question'][:50]!r} -> {task.hidden_tests['answer']}: "
                              f"reward {rewards[s]} {replies}")
                for d in dirs:
                    d.cleanup()
            n = args.tasks * args.samples
            mean_calls = sum(pass_calls) / len(pass_calls) if pass_calls else 0.0
            print(f"{args.kinds} d={args.difficulty} T={temperature} turns={args.turns}: {n} rollouts, looked first "
                  f"{looked / n:.0%}, passed {passed / n:.0%}, calls to the passing answer {mean_calls:.2f}, groups "
                  f"with reward variance {varied}/{args.tasks}; {time.monotonic() - t0:.0f} s, load average "
                  f"{load0:.1f} -> {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        engine.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--kinds", default="lookup", help="procedural kinds, comma-separated")
    p.add_argument("--difficulty", type=int, default=1)
    p.add_argument("--seed-offset", type=int, default=0)
    p.add_argument("--temperatures", default="0.4")
    p.add_argument("--tasks", type=int, default=8)
    p.add_argument("--samples", type=int, default=4, help="rollouts per task (a group)")
    p.add_argument("--turns", type=int, default=3, help="model calls per rollout (mini's step_limit)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--stop", default="Output:", help="stop strings, |-separated ('' for none)")
    p.add_argument("--templates", default="multiturn", help="the harness's templates: multiturn | compact")
    p.add_argument("--system-file", help="a system template (Jinja) instead of the harness's")
    p.add_argument("--instance-file", help="an instance template (Jinja, {{task}}) instead of the harness's")
    p.add_argument("--observation-file", help="an observation template (Jinja, output.output) instead")
    p.add_argument("--show", action="store_true", help="print every rollout's replies")
    args = p.parse_args()
    import torch

    torch.set_num_threads(1)
    asyncio.run(probe(args))


if __name__ == "__main__":
    main()
