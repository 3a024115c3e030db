"""Learning benchmark: harnessrl's async GRPO and TRL's GRPOTrainer side by side, one invocation.

Task (`bench/larger_task.py`): the user message `Which number is larger, {a} or {b}? Reply with
only the number.` with no system message of ours, pairs drawn in turn from
`random.Random("larger-1234")` for training; reward 1 when the first integer of the reply is the
larger number (`--reward format_aware`: 1 for exactly the number, 0.5 for the number first).

Arms, run one after the other on the same model (SmolLM2-135M-Instruct), learning rate,
prompts x completions per step, reply cap and step budget:
  * harnessrl: `harnessrl.train.run.run` with the white-box single-turn harness (engine on
    one thread, trainer on another, `train.max_staleness` = 1);
  * TRL: `bench/trl_arm.py` in its own venv (trl 1.16.0, made by `trl_arm.py --setup` on the
    first run), TRL's defaults otherwise.
Both final models are scored by one held-out evaluation (`held_out`): 64 prompts of seed
987654, greedy, replies <= 24 tokens, on harnessrl's engine; lenient and strict pass, mean
completion length and the fraction of replies cut at the cap, and the lenient pass of
`--eval-samples` replies a prompt at temperature 1.0 (`sampled`). Printed: both training wall
times and their ratio (goal: harnessrl >= 90% held-out in <= 60% of TRL's time), and each
arm's ratio-clip fraction over its steps.

Anchor measured earlier on a 2-core machine (TRL, one torch thread): 33% -> 91% held-out in 51
steps and 10 minutes at lr 1e-5, 2 prompts x 4 completions per step.

    .venv/bin/python bench/learning.py                        # both arms, 51 steps, lr 1e-5
    .venv/bin/python bench/learning.py --arms harnessrl --lr 3e-5 --steps 68
    .venv/bin/python bench/learning.py --harness mini-swe-agent --steps 20   # through the agent
    .venv/bin/python bench/learning.py --lr 3e-5 --bf16 harnessrl   # harnessrl in bfloat16, TRL float32
    .venv/bin/python bench/learning.py --lr 3e-5 --bf16 harnessrl --dynamic-sampling 6   # + DAPO's dynamic sampling
    .venv/bin/python bench/learning.py --steps 68 --lr 3e-5 --bf16 harnessrl --dynamic-sampling 6 --seeds 0,1,2
    .venv/bin/python bench/learning.py --steps 68 --lr 5e-5 --bf16 harnessrl --dynamic-sampling 6 --seeds 0,1,2   # the goal's setting
    .venv/bin/python bench/learning.py --seeds 0,1,2 ...      # the side-by-side at each seed, and a summary

`--bf16 harnessrl` gives harnessrl's engine bfloat16 weights and its trainer `train.autocast`
(on a CPU with AMX or AVX512-BF16 the engine decodes ~1.9x faster and a train step is several
times cheaper; on one without native bfloat16, AVX2 only, torch emulates it and a train step is
~10x slower: leave it off there; `train/step.py:native_cpu_bfloat16` tells which); `--bf16 both` also runs TRL with
`bf16=True`, which on this CPU path was slower than its float32 (432 vs 393 s, likely because
its autocast recasts the float32 weights at every decode step), so TRL's fastest arm is its
float32 one.

`--dynamic-sampling N` turns on harnessrl's `train.dynamic_sampling_max_groups`: a group whose
four rewards are all equal gives no gradient (in TRL too, where such a step's loss is 0), and is
replaced by another, at most N a step, so that every update has `--prompts-per-step` groups with
signal. Each arm still trains on the same number of groups and completions per update. harnessrl
generates more for it, and TRL has no such option. N = 2 is often too few: at seed 0 (51 steps) 13
of the 51 updates had one group with signal or none, and 20 rows arrived too stale to train
(replacements left over at the bound, generated early and taken by the next step, seen in its
metrics; such a group now counts as one without signal and is replaced); N = 6
gave both groups to 49, 35 and 51 of 51 updates at seeds 0, 1, 2 (0, 12, 0 stale rows), the extra
generation running while the trainer trains.

At lr 3e-5 (68 steps, dynamic sampling 6) the two arms end level near 90% and harnessrl passes
90% at one seed of three. At lr 5e-5, the same for both arms, it passes at all three: harnessrl
90.6 / 93.8 / 93.8% in 296 / 271 / 240 s, TRL 90.6 / 90.6 / 92.2% in 526 / 522 / 437 s, ratios
0.56 / 0.52 / 0.55 (2-core EPYC with AVX512-BF16, seeds 0, 1, 2). The harnessrl arm measures no update norm
(`--update-norm-every 0`), since TRL measures none.

`--task lookup`: the multi-turn side-by-side (`bench/lookup_env.py`). Both arms train on harnessrl's
procedural `lookup` tasks (`--lookup-kind`, `--difficulty`; the number in a named file of a
three-file workspace, answered as the reply) through a tool loop with one tool, `bash`, at most
`--max-turns` replies of at most `--max-tokens` (48) tokens each, temperature 1.0:
  * harnessrl: the white-box harness (`tools = ["bash"]`, its local sandbox), async as above
    but with its trainer on 2 torch threads (`--train-threads`): its rows are ~10x the larger
    task's and the arm is training-bound (seed 1, 6 steps: 106 s against 143 s with 1 thread).
    In 6 steps with a bfloat16 engine (`--bf16 harnessrl`), staleness 1 learned less per step
    than TRL at seed 1 (56-67% sampled pass in three runs, against 90.6-96.1% with staleness 0 or a
    float32 engine); `--max-staleness 0 --dynamic-sampling 0` runs it on-policy on the same
    groups as TRL, the setting the goal was met in at three seeds (docs/benchmarks.md);
  * TRL: `GRPOTrainer(environment_factory=LookupEnv)`, its in-process multi-turn loop
    (`bench/trl_arm.py --task lookup`: why its SmolLM2 run uses TRL's bundled Qwen2.5 chat
    template, and how its per-rollout budget is set).
The held-out evaluation (`held_out_lookup`) runs both final models through harnessrl's own
evaluation path (`train/evaluation.py:evaluate_held_out`: the white-box harness, its sandbox,
the proxy, the engine and the verifier): `--eval-prompts` tasks of the held-out offset, once
greedy (`pass`) and `--eval-samples` times at temperature 1.0 (`sampled`, the finer measure once
greedy saturates). The goal is harnessrl's greedy held-out pass >= TRL's in <= 60% of TRL's
training time. Each arm prints how many steps had a group with unequal rewards. `--seeds` runs
each seed in a process of its own (`--seeds S` alone runs seed S), and each arm trains and is
scored in a process of its own (`arm_in_child`; when the arms shared one, its heap peaked at
9.5-15 GB and the kernel's OOM killer once ended a run): the table's `RSS GB` is that process's
peak (for TRL the larger of its process and the scoring one). `--rescore DIR ...` trains
nothing and scores the final models of earlier runs with this evaluation. Time to accuracy,
async against sync at several staleness bounds, is `bench/async_learning.py`.

SmolLM2-135M-Instruct itself writes no `<tool_call>` for these prompts (0 of 64 samples at
temperature 1.0, none greedy; with a worked example in the system message, in the user message
or as two demonstration turns, at most 4 of 64 samples wrote a call and none ran `cat`), so from
it neither arm gets a reward and the goal holds only vacuously. Both arms therefore start, by
default, from the tool-calling warm start (`bench/tool_warmstart.py`: a short fine-tune of
`--model` on demonstrations of lookup tasks from a third seed range, each tokenised as the arm
that meets it feeds it to the model; built once, cached under ~/.cache/harnessrl/bench/), which
calls the tool but answers right only part of the time; its held-out scores are the table's
`base` row. `--no-warm-start` starts from `--model` itself; `--model DIR` runs on another model.

    .venv/bin/python bench/learning.py --task lookup --steps 6 --lr 5e-5 --eval-prompts 32 --bf16 harnessrl --dynamic-sampling 0 --max-staleness 0 --seeds 0,1,2   # the goal's setting
    .venv/bin/python bench/learning.py --task lookup --steps 6 --lr 5e-5 --eval-prompts 32 --bf16 harnessrl --dynamic-sampling 6 --seeds 0,1,2   # async, staleness 1
    .venv/bin/python bench/learning.py --task lookup --no-warm-start --steps 4 --lr 5e-5 --eval-prompts 32   # from the model itself
    .venv/bin/python bench/learning.py --task lookup --eval-prompts 32 --rescore OUT/seed-0 OUT/seed-1   # score again
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import larger_task as lt  # noqa: E402


async def held_out(model_dir: Path, n_prompts: int, threads: int, max_tokens: int = 24,
                   samples: int = 0) -> dict[str, float]:
    """Held-out scores of the model in `model_dir` on `n_prompts` prompts of the held-out seed:
    greedy lenient / strict pass, mean completion tokens, fraction cut at `max_tokens`, and
    `sampled_pass`, the lenient pass over `samples` replies a prompt at temperature 1.0 (request
    seeds 0..n_prompts * samples - 1, the same for every model; NaN with `samples` 0)."""
    from harnessrl.chat.layer import ChatLayer, normalize_messages
    from harnessrl.engine.embedded.engine import EmbeddedEngine
    from harnessrl.engine.model_store import load_tokenizer
    from harnessrl.types import Sampling

    pairs = lt.pairs(lt.HELD_OUT_SEED, n_prompts)
    chat = ChatLayer(load_tokenizer(model_dir))
    engine = EmbeddedEngine(model_dir, num_threads=threads, max_batch_size=64)
    try:
        prompts = [chat.render(normalize_messages([{"role": "user", "content": lt.prompt(a, b)}])) for a, b in pairs]
        completions = await asyncio.gather(*(engine.generate(p, Sampling(temperature=0.0, max_tokens=max_tokens))
                                             for p in prompts))
        sampled = await asyncio.gather(*(
            engine.generate(p, Sampling(temperature=1.0, max_tokens=max_tokens, seed=i * samples + j))
            for i, p in enumerate(prompts) for j in range(samples)))
    finally:
        engine.close()
    texts = [chat.parse(list(c.completion_ids), False).content or "" for c in completions]
    lengths = [len(c.completion_ids) for c in completions]
    sampled_texts = [chat.parse(list(c.completion_ids), False).content or "" for c in sampled]
    sampled_pairs = [p for p in pairs for _ in range(samples)]
    return {"pass": sum(lt.lenient(t, max(p)) for t, p in zip(texts, pairs)) / n_prompts,
            "sampled_pass": (sum(lt.lenient(t, max(p)) for t, p in zip(sampled_texts, sampled_pairs)) / len(sampled)
                             if sampled else float("nan")),
            "strict_pass": sum(lt.strict(t, max(p)) for t, p in zip(texts, pairs)) / n_prompts,
            "mean_completion_tokens": sum(lengths) / n_prompts,
            "cap_frac": sum(n >= max_tokens for n in lengths) / n_prompts}


def train_harnessrl(args: argparse.Namespace, run_dir: Path, task: list[str]) -> tuple[Path, float, list[dict]]:
    """Train with harnessrl on the arms' shared settings (model, sampling, group and step shape,
    learning rate, staleness, threads, precision) plus `task`'s overrides (harness, tasks,
    verifier); returns (final checkpoint, training wall seconds, step metrics)."""
    from harnessrl.config import load_config
    from harnessrl.train.run import run as train
    from harnessrl.train.policy import latest_checkpoint

    concurrent = args.completions * args.prompts_per_step * (args.max_staleness + 1)
    bf16 = args.bf16 in ("both", "harnessrl")
    cfg = load_config(None, [
        f"engine.model={json.dumps(args.model)}", "engine.num_threads=1", "harness.kind=\"white_box\"",
        *task, 'hooks.rollout_reward_fn=""',
        "sampling.temperature=1.0", f"sampling.max_tokens={args.max_tokens}",
        f"rollout.group_size={args.completions}", f"rollout.max_concurrent_rollouts={concurrent}",
        f"train.steps={args.steps}", f"train.groups_per_step={args.prompts_per_step}",
        f"train.learning_rate={args.lr}", f"train.lr_schedule={json.dumps(args.lr_schedule)}",
        f"train.max_staleness={args.max_staleness}",
        f"train.dynamic_sampling_max_groups={args.dynamic_sampling}",
        # TRL logs no update norm; harnessrl's would read the AdamW moments once a step
        f"log.update_norm_every={args.update_norm_every}",
        f"train.num_threads={args.train_threads}", f"seed={args.seed}",
        f"train.autocast={json.dumps('bfloat16' if bf16 else 'off')}",
        f"engine.dtype={json.dumps('bfloat16' if bf16 else 'float32')}", *args.set,
    ])
    t0 = time.monotonic()
    history = asyncio.run(train(cfg, run_dir))
    seconds = time.monotonic() - t0
    checkpoint = latest_checkpoint(run_dir)
    assert checkpoint is not None, "training saved no checkpoint"
    return checkpoint, seconds, history


def harnessrl_arm(args: argparse.Namespace, run_dir: Path) -> tuple[Path, float, list[dict]]:
    """The larger-number task through the white-box single-reply harness (`train_harnessrl`)."""
    task_file = BENCH / "larger_task.py"
    return train_harnessrl(args, run_dir, [
        "harness.options={tools = [], max_turns = 1}", "tasks.kind=\"python\"",
        f"tasks.source={json.dumps(f'{task_file}:make_source')}",
        f"tasks.verifier={json.dumps(f'{task_file}:make_verifier')}",
        f"tasks.verifier_kwargs={{reward = {json.dumps(args.reward)}}}",
    ])


class TrlArmFailed(RuntimeError):
    """The TRL process failed; the side-by-side prints harnessrl's arm and the reason."""


def trl_arm(args: argparse.Namespace, model_dir: Path, out: Path) -> tuple[Path, float, list[dict]]:
    """Train with TRL in its venv; returns (final model, training wall seconds, TRL's step log)."""
    python = subprocess.run([sys.executable, str(BENCH / "trl_arm.py"), "--setup"], check=True,
                            capture_output=True, text=True).stdout.strip().splitlines()[-1]
    cmd = [python, str(BENCH / "trl_arm.py"), "--model", str(model_dir), "--out", str(out),
           "--steps", str(args.steps), "--lr", str(args.lr), "--lr-schedule", args.lr_schedule,
           "--prompts-per-step", str(args.prompts_per_step),
           "--completions", str(args.completions), "--max-tokens", str(args.max_tokens),
           "--threads", str(args.trl_threads), "--reward", args.reward, "--seed", str(args.seed),
           *(["--bf16"] if args.bf16 == "both" else []),
           *(["--task", "lookup", "--max-turns", str(args.max_turns), "--lookup-kind", args.lookup_kind,
              "--difficulty", str(args.difficulty), "--chat-template", args.chat_template]
             if args.task == "lookup" else [])]
    t0 = time.monotonic()
    done = subprocess.run(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1",
                                    "TRL_EXPERIMENTAL_SILENCE": "1"})
    if done.returncode != 0:
        raise TrlArmFailed(f"the TRL arm exited with {done.returncode} (its error is printed above)")
    wall = time.monotonic() - t0
    report = json.loads((out / "report.json").read_text())
    print(f"trl arm: training {report['train_s']:.0f} s of {wall:.0f} s in its process", flush=True)
    return out / "model", report["train_s"], [m for m in report["log"] if "reward" in m]


async def held_out_lookup(model_dir: Path, args: argparse.Namespace, threads: int) -> dict[str, float]:
    """`--task lookup`: held-out scores of the model in `model_dir` on `--eval-prompts` tasks of
    the held-out offset (`lookup_env.HELD_OUT_OFFSET`), run through harnessrl's own evaluation
    path (`train/evaluation.py:evaluate_held_out`: the white-box harness with the `bash` tool,
    its sandbox, the proxy, the engine and the procedural verifier, as the harnessrl arm's
    training runs them) under the arms' rules: at most `--max-turns` replies of at most
    `--max-tokens` tokens, a reply without a tool call is the answer.

    Two evaluations of the same tasks: greedy (one rollout a task) and sampled at temperature
    1.0, the training temperature (`--eval-samples` rollouts a task, run seed `EVAL_SEED`, the
    same for every model). Returns `pass` (greedy), `sampled_pass` (over the sampled rollouts;
    NaN with `--eval-samples 0`), `tool_call_frac` (greedy rollouts whose first reply called a
    tool), `mean_completion_tokens` (model tokens a greedy rollout), `cap_frac` (greedy replies
    cut at `--max-tokens`), `turns_passing` (replies a passing greedy rollout) and `errors`
    (rollouts of either evaluation that ended in an agent, infra or verifier error; each counts
    as not passing) and `timeouts` (rollouts of either that ran past `EVAL_AGENT_TIMEOUT_S`,
    also not passing)."""
    from harnessrl.rollout.summary import ERROR_STATUSES, passed

    greedy = await _eval_lookup(model_dir, args, threads, samples=1, temperature=0.0)
    sampled = (await _eval_lookup(model_dir, args, threads, samples=args.eval_samples, temperature=1.0)
               if args.eval_samples else [])
    turns = [t for r in greedy for t in r.trace.turns]
    passing = [r for r in greedy if passed(r)]
    first_called = [r for r in greedy if r.trace.turns and r.trace.turns[0].reply is not None
                    and r.trace.turns[0].reply.tool_calls]
    return {"pass": len(passing) / len(greedy),
            "sampled_pass": sum(map(passed, sampled)) / len(sampled) if sampled else float("nan"),
            "tool_call_frac": len(first_called) / len(greedy),
            "mean_completion_tokens": sum(len(t.completion_ids) for t in turns) / len(greedy),
            "cap_frac": sum(len(t.completion_ids) >= args.max_tokens for t in turns) / max(len(turns), 1),
            "turns_passing": sum(len(r.trace.turns) for r in passing) / len(passing) if passing else 0.0,
            "errors": float(sum(r.status in ERROR_STATUSES for r in greedy + sampled)),
            "timeouts": float(sum(r.status == "timeout" for r in greedy + sampled))}


EVAL_SEED = 0
EVAL_AGENT_TIMEOUT_S = 3600.0
"""A held-out rollout's time limit: far above the training run's 180 s, so that on a loaded
machine (32 greedy and 128 sampled rollouts at once on 2 cores beside other jobs) the
evaluation scores the policy rather than the machine: at load 16-19, under the 180 s limit, no
greedy rollout of a final checkpoint recorded a completion token (0% greedy pass, 17% sampled)
while the same checkpoint, evaluated alone on 3 tasks, passed all 3."""
"""Run seed of every `--task lookup` held-out evaluation (sampling), whatever the training seed."""


async def _eval_lookup(model_dir: Path, args: argparse.Namespace, threads: int, *, samples: int,
                       temperature: float) -> list[Any]:
    """`samples` rollouts of each of the `--eval-prompts` held-out lookup tasks of the model in
    `model_dir` at `temperature`, through `start_runtime` and `evaluate_held_out`; the rollouts."""
    import lookup_env as le
    from harnessrl.config import load_config
    from harnessrl.rollout.runner import RolloutLimits
    from harnessrl.runtime import start_runtime
    from harnessrl.train.evaluation import evaluate_held_out
    from harnessrl.types import Rollout

    cfg = load_config(None, [
        f"engine.model={json.dumps(str(model_dir))}", f"engine.num_threads={threads}",
        "engine.max_batch_size=64", "harness.kind=\"white_box\"",
        f"harness.options={{tools = [\"bash\"], max_turns = {args.max_turns}}}",
        "tasks.kind=\"procedural\"", f"tasks.kinds=[{json.dumps(args.lookup_kind)}]",
        f"tasks.difficulty={args.difficulty}", "tasks.answer_via=\"reply\"",
        f"tasks.seed_offset={le.HELD_OUT_OFFSET}", f"tasks.limit={args.eval_prompts}",
        # greedy as top-k 1 (a run's sampling.temperature is > 0; the proxy enforces top_k)
        'hooks.rollout_reward_fn=""', f"sampling.temperature={temperature or 1.0}",
        f"sampling.top_k={0 if temperature else 1}",
        f"sampling.max_tokens={args.max_tokens}", f"rollout.group_size={samples}",
        f"rollout.agent_timeout_s={EVAL_AGENT_TIMEOUT_S}", f"seed={EVAL_SEED}",
    ])
    with tempfile.TemporaryDirectory(prefix="lookup-eval-") as tmp:
        async with start_runtime(cfg, run_dir=Path(tmp)) as rt:
            await evaluate_held_out(rt, rt.tasks, samples=samples, max_concurrent=min(64, len(rt.tasks) * samples),
                                    limits=RolloutLimits(cfg.rollout.agent_timeout_s, cfg.rollout.verify_timeout_s),
                                    out_dir=Path(tmp) / "eval")
        lines = (Path(tmp) / "eval" / "rollouts.jsonl").read_text().splitlines()
    return [Rollout.model_validate_json(line) for line in lines]


def lookup_harnessrl_arm(args: argparse.Namespace, run_dir: Path) -> tuple[Path, float, list[dict]]:
    """`--task lookup`: train with harnessrl's white-box tool loop (`bash` only, `--max-turns`
    model calls, each reply at most `--max-tokens`) on the procedural lookup tasks; returns
    (final checkpoint, training wall seconds, step metrics)."""
    return train_harnessrl(args, run_dir, [
        f"harness.options={{tools = [\"bash\"], max_turns = {args.max_turns}}}",
        "tasks.kind=\"procedural\"", f"tasks.kinds=[{json.dumps(args.lookup_kind)}]",
        f"tasks.difficulty={args.difficulty}", "tasks.answer_via=\"reply\"",
    ])


def agent_curve(args: argparse.Namespace, run_dir: Path) -> None:
    """`--harness NAME`: the main job's default tasks (procedural `repeat`) through
    a real agent, with a held-out evaluation of 16 tasks every `--eval-every` steps (the curve
    is the run's own); the run's other defaults are the main job's (temperature 0.4, for
    mini-swe-agent its compact prompt and one step)."""
    from harnessrl.config import load_config
    from harnessrl.train.run import run as train

    cfg = load_config(None, [
        f"engine.model={json.dumps(args.model)}", f"harness.kind={json.dumps(args.harness)}",
        f"rollout.group_size={args.completions}",
        f"rollout.max_concurrent_rollouts={args.completions * args.prompts_per_step}",
        f"train.steps={args.steps}", f"train.groups_per_step={args.prompts_per_step}",
        f"train.learning_rate={args.lr}", f"train.eval_every={args.eval_every}", "train.eval_size=16",
        "train.eval_samples=1", f"train.num_threads={args.train_threads}", *args.set,
    ])
    t0, load0 = time.monotonic(), os.getloadavg()[0]
    history = asyncio.run(train(cfg, run_dir))
    evals = [(m["step"], m["eval/pass_rate"]) for m in history if "eval/pass_rate" in m]
    print(f"{args.harness}: {args.steps} steps in {time.monotonic() - t0:.0f} s; held-out pass by step: {evals}; "
          f"load average {load0:.1f} -> {os.getloadavg()[0]:.1f}; curve {run_dir / 'curve.png'}")


def _seed_list(text: str) -> list[int]:
    try:
        return [int(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seeds wants integers separated by commas, got {text!r}") from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (`--max-tokens` filled in by `--task`)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--arms", default="both", choices=["both", "harnessrl", "trl"])
    p.add_argument("--steps", type=int, default=51)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--lr-schedule", default="linear", choices=["linear", "cosine", "constant"],
                   help="both arms (TRL's default, the HF Trainer's, is linear decay to 0)")
    p.add_argument("--completions", type=int, default=4, help="completions per prompt (group size)")
    p.add_argument("--prompts-per-step", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=None, help="reply cap, training and held-out "
                   "(default 24; with --task lookup 48, each reply)")
    p.add_argument("--task", default="larger", choices=["larger", "lookup"],
                   help="larger: the single-turn larger-number task; lookup: harnessrl's procedural lookup "
                   "family through a tool loop in both arms (bench/lookup_env.py)")
    p.add_argument("--max-turns", type=int, default=3, help="--task lookup: most model calls a rollout")
    p.add_argument("--lookup-kind", default="lookup", choices=["lookup", "lookup_count", "lookup_json"])
    p.add_argument("--difficulty", type=int, default=1, help="--task lookup: lookups summed a task")
    p.add_argument("--chat-template", default="auto", choices=["auto", "own", "qwen2.5"],
                   help="--task lookup: the template the TRL arm renders with (bench/trl_arm.py); "
                   "auto: the model's own when TRL accepts it for tools, else TRL's bundled Qwen2.5 one")
    p.add_argument("--warm-start", action=argparse.BooleanOptionalAction, default=None,
                   help="--task lookup (its default): both arms start from the tool-calling warm start "
                   "(bench/tool_warmstart.py, a short fine-tune on demonstrations of disjoint lookup tasks), "
                   "built once and cached; --no-warm-start: from --model itself")
    p.add_argument("--warm-start-answer-frac", type=float, default=None, metavar="F",
                   help="the warm start's fraction of demonstrations whose final answer is trained "
                   "(tool_warmstart.Config.answer_frac)")
    p.add_argument("--reward", default="lenient", choices=["lenient", "format_aware"])
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument("--dynamic-sampling", type=int, default=0, metavar="N",
                   help="harnessrl's train.dynamic_sampling_max_groups: a step whose groups have all-equal "
                   "rewards draws up to N more groups so that every update has --prompts-per-step groups "
                   "with signal (DAPO's dynamic sampling); TRL has no such option")
    p.add_argument("--update-norm-every", type=int, default=0, help="harnessrl's log.update_norm_every "
                   "(param_delta_l2 every N updates; 0, the bench default: never, as TRL measures none)")
    p.add_argument("--seed", type=int, default=0, help="both arms' run seed (sampling, TRL's data order)")
    p.add_argument("--seeds", type=_seed_list, default=[], metavar="S1,S2,...", help="run the side-by-side at each of these "
                   "seeds in turn (OUT/seed-S/ each) and print a summary: per seed, each arm's pass, time "
                   "and the ratio; each arm's mean pass; how many seeds meet the goal")
    p.add_argument("--train-threads", type=int, default=None, help="torch threads of harnessrl's trainer "
                   "(default 1; with --task lookup 2: its rows are ~10x longer and the arm is training-bound, "
                   "the engine decoding on one thread beside it)")
    p.add_argument("--trl-threads", type=int, default=2, help="torch threads of the TRL process (it "
                   "generates and trains in turn, so it gets both cores)")
    p.add_argument("--bf16", default="none", choices=["none", "both", "harnessrl"],
                   help="bfloat16 in harnessrl's arm (its engine holds bfloat16 weights, engine.dtype, and "
                   "its trainer runs train.autocast) and with 'both' in TRL's (bf16=True: torch.autocast "
                   "over its float32 model, generation included); the held-out evaluation stays float32")
    p.add_argument("--eval-prompts", type=int, default=64)
    p.add_argument("--eval-samples", type=int, default=4, help="rollouts (--task lookup) or replies (larger) a "
                   "held-out task sampled at temperature 1.0 for the `sampled` column, besides the greedy one (0: none)")
    p.add_argument("--rescore", type=Path, nargs="+", default=None, metavar="DIR",
                   help="--task lookup: train nothing; score the final models of earlier side-by-side "
                   "runs (each DIR an OUT or OUT/seed-S of one, with harnessrl/checkpoints and trl/model) "
                   "with this evaluation and print their table with the training times they recorded")
    p.add_argument("--base-scores", type=Path, default=None, help=argparse.SUPPRESS)  # --seeds' children
    p.add_argument("--arm-only", default=None, choices=["harnessrl", "trl"], help=argparse.SUPPRESS)  # an arm's process
    p.add_argument("--harness", default="white_box", help="white_box (the side-by-side), or an agent "
                   "(mini-swe-agent, ...) for a curve through it")
    p.add_argument("--eval-every", type=int, default=5, help="with --harness AGENT")
    p.add_argument("--set", action="append", default=[], help="a harnessrl config override for the harnessrl arm (TRL's arm takes none), "
                   "e.g. --set 'train.loss={kind = \"cispo\"}'; repeatable")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.max_tokens is None:
        args.max_tokens = 48 if args.task == "lookup" else 24
    if args.train_threads is None:
        args.train_threads = 2 if args.task == "lookup" else 1
    if args.max_turns < 1 or args.difficulty < 1:
        p.error("--max-turns and --difficulty must be >= 1")
    if args.warm_start is None:
        args.warm_start = args.task == "lookup"
    if args.warm_start and args.task != "lookup":
        p.error("--warm-start is a --task lookup option")
    if args.rescore and args.task != "lookup":
        p.error("--rescore is a --task lookup option")
    if args.eval_samples < 0:
        p.error("--eval-samples must be >= 0")
    return args


def main() -> None:
    args = parse_args()

    import torch

    torch.set_num_threads(2)
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} cores)",
          flush=True)
    from harnessrl.engine.model_store import resolve_model

    out = args.out or Path(tempfile.mkdtemp(prefix="harnessrl-learning-"))
    out.mkdir(parents=True, exist_ok=True)
    if args.harness != "white_box":
        agent_curve(args, out / "agent")
        return
    model_dir = resolve_model(args.model)
    if args.warm_start:
        import tool_warmstart as tw

        cfg = tw.default_config(**({"answer_frac": args.warm_start_answer_frac}
                                   if args.warm_start_answer_frac is not None else {}))
        model_dir = tw.warm_start(model_dir, cfg, threads=2)
        args.model = str(model_dir)  # both arms start from it
        print(f"both arms start from the tool warm start {model_dir}", flush=True)
    if args.arm_only:
        one_arm(args, args.arm_only, model_dir, out)
        return
    if args.rescore:
        rescore(args, model_dir, out)
        return
    if args.base_scores is not None:
        base = json.loads(args.base_scores.read_text())
    else:
        base = asyncio.run(evaluate(model_dir, args))
    seeds = args.seeds or [args.seed]
    args.seed = seeds[0]  # `--seeds S` alone runs seed S
    if len(seeds) > 1:
        # one process a seed: a process's heap only grows over the arms it trains and scores
        # (12 GB after a seed and a half, killed by the kernel once), so each seed starts bare
        (out / "base.json").write_text(json.dumps(base))
        runs = {s: seed_in_child(s, out / f"seed-{s}", out / "base.json") for s in seeds}
    else:
        runs = {seeds[0]: side_by_side(args, model_dir, base, out)}
    if len(seeds) > 1:
        summary(runs, args.task)
    (out / "learning.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                   "base": base, "seeds": runs}, indent=1))
    print(f"results: {out / 'learning.json'}")


def seed_in_child(seed: int, out: Path, base_scores: Path) -> dict:
    """`--seeds`: the side-by-side at `seed` in a process of its own (this command line without
    `--seeds` and `--out`, plus `--seed`, `--out OUT` and the base row's scores); its result.

    Raises:
        RuntimeError: the child failed (its output is above)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), *child_argv(sys.argv[1:], seed, out, base_scores)]
    if subprocess.run(cmd).returncode != 0:
        raise RuntimeError(f"the side-by-side at seed {seed} failed: {' '.join(cmd)}")
    return json.loads((out / "learning.json").read_text())["seeds"][str(seed)]


def child_argv(argv: list[str], seed: int, out: Path, base_scores: Path | None) -> list[str]:
    """`argv` without its `--seeds`, `--seed`, `--out`, `--base-scores` and `--arm-only` (either
    spelling), then `--seed SEED --out OUT` and, given one, `--base-scores FILE`."""
    dropped = ("--seeds", "--out", "--seed", "--base-scores", "--arm-only")
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in dropped:
            skip = True
        elif not arg.startswith(tuple(f"{d}=" for d in dropped)):
            kept.append(arg)
    return [*kept, "--seed", str(seed), "--out", str(out),
            *(["--base-scores", str(base_scores)] if base_scores is not None else [])]


def recorded_args(d: Path, args: argparse.Namespace) -> argparse.Namespace:
    """`args` with the training settings (steps, learning rate and schedule, precision, seed) of
    the run that wrote `d` (its or its parent's `learning.json` `args`; a `seed-S` name gives the
    seed), for `--rescore`'s table header; the evaluation settings stay `args`'."""
    out = dict(vars(args))
    for f in (d / "learning.json", d.parent / "learning.json"):
        rec = json.loads(f.read_text()).get("args") if f.exists() else None
        if rec:
            for key, kind in (("steps", int), ("lr", float), ("lr_schedule", str), ("bf16", str),
                              ("seed", int), ("prompts_per_step", int), ("completions", int)):
                if key in rec:
                    out[key] = kind(rec[key])
            break
    if d.name.startswith("seed-") and d.name[5:].isdigit():
        out["seed"] = int(d.name[5:])
    return argparse.Namespace(**out)


def rescore(args: argparse.Namespace, model_dir: Path, out: Path) -> None:
    """`--rescore DIR ...`: the base row and each DIR's final models (`harnessrl/checkpoints/step-N`,
    `trl/model`) scored by this evaluation; the training times are the ones DIR's `learning.json`
    recorded. Prints each DIR's table and, for several, the summary; writes OUT/rescore.json."""
    from harnessrl.train.policy import latest_checkpoint

    base = asyncio.run(evaluate(model_dir, args))
    runs: dict[str, dict] = {}
    for d in args.rescore:
        recorded = json.loads((d / "learning.json").read_text())
        if "seeds" in recorded:  # an OUT of one seed: its run is under its seed's key
            recorded = next(iter(recorded["seeds"].values()))
        results: dict[str, dict] = {"base": base}
        models = {"harnessrl": latest_checkpoint(d / "harnessrl"), "trl": d / "trl" / "model"}
        for arm, path in models.items():
            if path is not None and (path / "config.json").exists() and arm in recorded["train_s"]:
                results[arm] = asyncio.run(evaluate(path, args))
        print(f"\n{d}:")
        print_table(recorded_args(d, args), results, recorded["train_s"], recorded.get("clip", {}), recorded.get("load_avg", {}))
        runs[str(d)] = {**recorded, "held_out": results,
                        "held_out_recorded": recorded["held_out"]}
    if len(runs) > 1:
        summary({k: v for k, v in runs.items() if all(a in v["held_out"] for a in v["train_s"])}, args.task)
    (out / "rescore.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                  "runs": runs}, indent=1))
    print(f"results: {out / 'rescore.json'}")


def evaluate(model_dir: Path, args: argparse.Namespace) -> Any:
    """The held-out evaluation of `--task` (a coroutine), two engine threads."""
    if args.task == "lookup":
        return held_out_lookup(model_dir, args, threads=2)
    return held_out(model_dir, args.eval_prompts, threads=2, max_tokens=args.max_tokens, samples=args.eval_samples)


def goal_met(args_task: str, passes: dict[str, float], ratio: float) -> bool:
    """larger: harnessrl >= 90% held-out in <= 60% of TRL's time; lookup: harnessrl's held-out
    pass >= TRL's in <= 60% of TRL's time."""
    floor = passes["trl"] if args_task == "lookup" else 0.9
    return passes["harnessrl"] >= floor and ratio <= 0.6


def side_by_side(args: argparse.Namespace, model_dir: Path, base: dict[str, float], out: Path) -> dict:
    """Both arms (or one, `--arms`) at `args.seed`, each in a process of its own (`arm_in_child`:
    an arm's heap, 9.5-15 GB at its peak when the arms shared a process, is returned when it
    exits); prints their table and returns {"held_out": {arm: scores}, "train_s": {arm: s},
    "clip": {arm: frac}, "load_avg": {arm: load}, "peak_rss_gb": {arm: GB}, ...}."""
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {"base": base}
    times: dict[str, float] = {}
    clip: dict[str, float] = {}
    load: dict[str, float] = {}  # 1-minute load average, mean of each arm's start and end values
    rss: dict[str, float] = {}
    trl_failure = ""
    signal: dict[str, int] = {}  # steps whose groups had unequal rewards (a gradient)
    for arm in [a for a in ("harnessrl", "trl") if args.arms in ("both", a)]:
        load0 = os.getloadavg()[0]
        try:
            done = arm_in_child(arm, args.seed, out / arm)
        except TrlArmFailed as exc:
            trl_failure = str(exc)
            continue
        load[arm] = (load0 + os.getloadavg()[0]) / 2
        results[arm], times[arm], clip[arm] = done["held_out"], done["train_s"], done["clip"]
        signal[arm], rss[arm] = done["signal_steps"], done["peak_rss_gb"]
    print_table(args, results, times, clip, load, rss)
    if trl_failure:
        print(f"TRL arm: no result ({trl_failure})")
    goal = None
    if "harnessrl" in times and "trl" in times:
        ratio = times["harnessrl"] / times["trl"]
        goal = goal_met(args.task, {a: results[a]["pass"] for a in ("harnessrl", "trl")}, ratio)
        wanted = "harnessrl's pass >= TRL's" if args.task == "lookup" else "harnessrl >= 90% held-out"
        vacuous = not any(signal.values()) and not any(r["pass"] for r in results.values())
        print(f"wall time ratio harnessrl / TRL: {ratio:.2f} (goal <= 0.60 with {wanted}): "
              f"goal {'met' if goal else 'not met'}"
              + (" only vacuously: no reward in either arm, so neither trained (harnessrl skips a step "
                 "without signal, TRL runs it with a zero loss)" if vacuous else ""))
    run = {"held_out": results, "train_s": times, "clip": clip, "load_avg": load, "goal": goal, "signal_steps": signal,
           "peak_rss_gb": rss, "trl_failure": trl_failure or None}
    (out / "learning.json").write_text(json.dumps(run, indent=1))
    return run


def one_arm(args: argparse.Namespace, arm: str, model_dir: Path, out: Path) -> dict:
    """`--arm-only ARM`: train `arm` at `args.seed` in this process and score its final model;
    writes and returns OUT/arm.json: held_out, train_s, clip (mean ratio-clip fraction over its
    steps), signal_steps, peak_rss_gb (`peak_rss_gb`) and the step metrics (`history`).

    Raises:
        TrlArmFailed: the TRL process failed."""
    out.mkdir(parents=True, exist_ok=True)
    if arm == "harnessrl":
        train = lookup_harnessrl_arm if args.task == "lookup" else harnessrl_arm
        checkpoint, seconds, history = train(args, out)
        scores = asyncio.run(evaluate(checkpoint, args))
        fracs = [m.get("clip_high_frac", 0.0) + m.get("clip_low_frac", 0.0) for m in history if "loss" in m]
        steps = [m for m in history if m.get("step", 0) > 0]
        signal = sum(1 for m in steps if not m.get("skipped"))
        print(f"harnessrl arm: {signal} of {len(steps)} steps updated; "
              f"{sum(m.get('groups_drawn_extra', 0.0) for m in steps):.0f} groups drawn beyond "
              f"{args.prompts_per_step} a step", flush=True)
    else:
        model, seconds, history = trl_arm(args, model_dir, out)
        scores = asyncio.run(evaluate(model, args))
        fracs = [float(m.get("clip_ratio/region_mean", 0.0)) for m in history]
        signal = sum(1 for m in history if float(m.get("frac_reward_zero_std", 0.0)) < 1.0)
        print(f"trl arm: {signal} of {len(history)} steps had a group with unequal rewards", flush=True)
    done = {"held_out": scores, "train_s": seconds, "clip": sum(fracs) / max(len(fracs), 1),
            "signal_steps": signal, "peak_rss_gb": peak_rss_gb(), "history": jsonable(history)}
    (out / "arm.json").write_text(json.dumps(done, indent=1))
    return done


def peak_rss_gb() -> float:
    """The peak resident memory (GB) of this process or of the largest process it waited for
    (the TRL arm's), whichever is higher (`getrusage`'s `ru_maxrss`, KB on Linux)."""
    import resource

    return max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)) / 1e6


def jsonable(history: list[dict]) -> list[dict]:
    """Step metrics with only their numbers and strings (JSON-writable)."""
    return [{k: v for k, v in m.items() if isinstance(v, (int, float, str))} for m in history]


def arm_in_child(arm: str, seed: int, out: Path, script: Path | None = None,
                 extra: tuple[str, ...] = ()) -> dict:
    """`arm` at `seed` in a process of its own: `script` (this one by default) with this command
    line, `--seed`, `--out OUT` and `--arm-only ARM` (plus `extra`); its OUT/arm.json.

    Raises:
        TrlArmFailed: the TRL arm's process failed.
        RuntimeError: the harnessrl arm's process failed (its output is above)."""
    argv = child_argv(sys.argv[1:], seed, out, None)
    cmd = [sys.executable, str(script or Path(__file__).resolve()), *argv, "--arm-only", arm, *extra]
    if subprocess.run(cmd).returncode != 0:
        if arm == "trl":
            raise TrlArmFailed(f"the TRL arm's process failed: {' '.join(cmd)}")
        raise RuntimeError(f"the {arm} arm at seed {seed} failed: {' '.join(cmd)}")
    return json.loads((out / "arm.json").read_text())


def print_table(args: argparse.Namespace, results: dict[str, dict], times: dict[str, float],
                clip: dict[str, float], load: dict[str, float], rss: dict[str, float] | None = None) -> None:
    """One seed's table: each arm's (and the base's) held-out scores, training seconds, mean
    ratio-clip fraction, load average and its process's peak RSS (GB)."""
    if args.task == "lookup":
        print(f"\n{args.lookup_kind} task (difficulty {args.difficulty}), tool loop (bash, <= {args.max_turns} "
              f"replies), seed {args.seed}, {args.steps} steps, lr {args.lr} ({args.lr_schedule}), bfloat16: "
              f"{args.bf16}, {args.prompts_per_step} prompts x {args.completions} completions per step, replies <= "
              f"{args.max_tokens} tokens (TRL also <= {args.max_turns * (args.max_tokens + 64)} a rollout, tool "
              f"results included); held-out: {args.eval_prompts} tasks (offset 1000000) through harnessrl's "
              f"white-box harness on its engine, greedy (pass) and {args.eval_samples} samples a task at "
              f"temperature 1.0 (sampled)")
        cols = [("pass", "pass"), ("sampled", "sampled_pass"), ("1st call", "tool_call_frac")]
    else:
        print(f"\nlarger-number task, seed {args.seed}, {args.steps} steps, lr {args.lr} ({args.lr_schedule}), "
              f"bfloat16: {args.bf16}, "
              f"{args.prompts_per_step} prompts x "
              f"{args.completions} completions per step, replies <= {args.max_tokens} tokens, reward {args.reward}; "
              f"held-out: {args.eval_prompts} prompts (seed {lt.HELD_OUT_SEED}), greedy (pass, strict) and "
              f"{args.eval_samples} samples a prompt at temperature 1.0 (sampled)")
        cols = [("pass", "pass"), ("strict", "strict_pass"), ("sampled", "sampled_pass")]
    print(f"{'arm':10} " + " ".join(f"{name:>8}" for name, _ in cols)
          + f" {'len':>6} {'at cap':>7} {'train s':>8} {'clip':>7} {'load':>5} {'RSS GB':>6}")
    for arm, r in results.items():
        t = f"{times[arm]:.0f}" if arm in times else "-"
        c = f"{clip[arm]:.4f}" if arm in clip else "-"
        ld = f"{load[arm]:.1f}" if arm in load else "-"
        gb = f"{rss[arm]:.1f}" if rss and arm in rss else "-"
        print(f"{arm:10} " + " ".join(f"{r.get(key, float('nan')):8.1%}" for _, key in cols)
              + f" {r['mean_completion_tokens']:6.1f} {r['cap_frac']:7.1%} {t:>8} {c:>7} {ld:>5} {gb:>6}")


def summary(runs: dict, task: str = "larger") -> None:
    """`--seeds`: one line per seed (each arm's held-out pass and training seconds, the time ratio,
    whether the goal holds), then each arm's mean pass and the number of seeds meeting the goal."""
    arms = [a for a in ("harnessrl", "trl") if all(a in r["train_s"] for r in runs.values())]
    print(f"\n{'seed':>5} " + " ".join(f"{a + ' pass':>15} {a + ' s':>12}" for a in arms)
          + (f" {'ratio':>6} {'goal':>5}" if len(arms) == 2 else ""))
    met = 0
    for seed, r in runs.items():
        line = f"{seed:>5} " + " ".join(f"{r['held_out'][a]['pass']:15.1%} {r['train_s'][a]:12.0f}" for a in arms)
        if len(arms) == 2:
            ratio = r["train_s"]["harnessrl"] / r["train_s"]["trl"]
            ok = goal_met(task, {a: r["held_out"][a]["pass"] for a in arms}, ratio)
            met += ok
            vacuous = not any(r.get("signal_steps", {"_": 1}).values()) and not any(
                r["held_out"][a]["pass"] for a in arms)
            line += f" {ratio:6.2f} {('yes' if ok else 'no') + (' (vacuous: no reward in either arm)' if vacuous else ''):>5}"
        print(line)
    means = " ".join(f"{a} {sum(r['held_out'][a]['pass'] for r in runs.values()) / len(runs):.1%}" for a in arms)
    print(f"mean held-out pass over {len(runs)} seeds: {means}"
          + (f"; goal met at {met} of {len(runs)} seeds" if len(arms) == 2 else ""))
    if task == "lookup":
        sampled = " ".join(f"{a} {sum(r['held_out'][a].get('sampled_pass', float('nan')) for r in runs.values()) / len(runs):.1%}"
                           for a in ("base", *arms))
        print(f"mean held-out pass sampled at temperature 1.0: {sampled}")


if __name__ == "__main__":
    main()
