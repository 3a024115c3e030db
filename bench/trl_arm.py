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
    VENV/bin/python bench/trl_arm.py --task lookup --model DIR --out OUT --steps 40 --max-turns 3

`--task lookup` (`bench/lookup_env.py`): TRL's multi-turn tool loop, `environment_factory` =
`LookupEnv` (its `bash` method the tool), the tasks of harnessrl's procedural lookup family in
harnessrl's order (`shuffle_dataset=False`), the reward harnessrl's exact-match outcome on the
final reply; `max_tool_calling_iterations` = `--max-turns` - 1, so at most `--max-turns` model
calls. Each reply is capped at `--max-tokens` as in harnessrl (`generation_kwargs`'
`max_new_tokens`, which TRL passes to every `generate` call); TRL's `max_completion_length`
bounds a rollout's whole completion (every reply and the tool results between them) and is set
to `--max-turns` x (`--max-tokens` + 64), room for the tool results (a `cat` result is ~20
tokens; harnessrl has no per-rollout bound but the context). TRL needs a chat
template that renders a tool-calling conversation (`supports_tool_calling`) and one it knows how
to parse (`add_response_schema` matches the template's text against its bundled ones): with
`--chat-template auto`, a template that fails the first (SmolLM2-135M-Instruct's, which writes
only `role` and `content`, dropping `tool_calls`) is replaced by TRL's bundled Qwen2.5 template
(same `<|im_start|>`/`<|im_end|>` tokens; tools described in the system message, hermes
`<tool_call>` blocks, tool results as `<tool_response>` in a user turn, which is how harnessrl's
chat layer renders tools for SmolLM2), and the reason is printed; `--chat-template own` keeps the
model's own (TRL then refuses to start with SmolLM2). The saved model gets the model's own
tokenizer files back, so the held-out evaluation renders both arms' models alike.
`--check-tool-loop` runs one batch of TRL's multi-turn path with fixed replies in place of the
model's (SmolLM2-135M writes no tool call of its own) and checks the call, its result, the masked
tool tokens and the reward; on SmolLM2 with the Qwen2.5 template: one call a rollout, result
`exit code 0\n15\n`, 30 tool-result tokens masked a rollout, reward mean 0.5 (one right answer, one wrong).

    VENV/bin/python bench/trl_arm.py --check-tool-loop --task lookup --model DIR --out OUT

`--render-lookup-demos IN OUT` writes the ids TRL's tool loop feeds the model for given
demonstrations, computed by TRL's own code (`bench/tool_warmstart.py` trains the lookup warm
start on them).
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
TOOL_RESULT_TOKENS = 64
"""Lookup: room a turn leaves for a tool result in TRL's per-rollout budget (module docstring)."""


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
    if args.task == "lookup":
        train_lookup(args)
        return
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


def lookup_tokenizer(model: str, choice: str):  # noqa: ANN201 - transformers type, TRL venv only
    """The tokenizer TRL gets for the lookup task (module docstring: `--chat-template`)."""
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen2_5_chat_template, supports_tool_calling

    tok = AutoTokenizer.from_pretrained(model)
    if choice == "qwen2.5" or (choice == "auto" and not supports_tool_calling(tok)):
        if choice == "auto":
            print("trl arm: the model's chat template cannot render a tool-calling conversation "
                  "(trl.chat_template_utils.supports_tool_calling is False: it drops the assistant's "
                  "tool_calls), so GRPOTrainer would refuse it (ValueError 'The provided chat template does "
                  "not support tool calling') and add_response_schema knows no parser for it "
                  "('Unrecognized chat template'); using TRL's bundled Qwen2.5 template instead", flush=True)
        tok.chat_template = qwen2_5_chat_template
    return tok


def train_lookup(args: argparse.Namespace) -> None:
    import shutil

    import torch

    torch.set_num_interop_threads(1)

    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    import lookup_env as le

    out = Path(args.out)
    config = GRPOConfig(
        output_dir=str(out / "trainer"), learning_rate=args.lr, lr_scheduler_type=args.lr_schedule,
        num_generations=args.completions,
        per_device_train_batch_size=args.completions * args.prompts_per_step,
        max_completion_length=args.max_turns * (args.max_tokens + TOOL_RESULT_TOKENS),
        generation_kwargs={"max_new_tokens": args.max_tokens},
        max_tool_calling_iterations=args.max_turns - 1, shuffle_dataset=False,
        max_steps=args.steps, use_cpu=True, bf16=args.bf16,
        logging_steps=1, save_strategy="no", report_to="none", seed=args.seed, dataloader_num_workers=0)
    rows = le.rows(args.steps * args.prompts_per_step, args.lookup_kind, args.difficulty)
    trainer = GRPOTrainer(model=args.model, reward_funcs=le.reward, args=config,
                          train_dataset=Dataset.from_list(rows),
                          processing_class=lookup_tokenizer(args.model, args.chat_template),
                          environment_factory=le.LookupEnv)
    t0 = time.monotonic()
    trainer.train()
    train_s = time.monotonic() - t0
    trainer.save_model(str(out / "model"))
    own = ("tokenizer", "chat_template", "special_tokens")
    for f in (out / "model").iterdir():
        if f.name.startswith(own):
            f.unlink()
    for f in Path(args.model).iterdir():  # the model's own tokenizer and template, not the one TRL used
        if f.name.startswith(own):
            shutil.copy(f, out / "model" / f.name)
    report = {"train_s": train_s, "steps": args.steps, "log": trainer.state.log_history}
    (out / "report.json").write_text(json.dumps(report, indent=1))
    print(f"trl arm: {args.steps} steps in {train_s:.0f} s", flush=True)


def check_tool_loop(args: argparse.Namespace) -> None:
    """`--check-tool-loop`: TRL's own multi-turn path with `LookupEnv`, without training and
    without relying on the model to call a tool: the model's sampling is replaced by fixed
    replies (first a hermes `cat` of the asked file, then, after the tool result, the right
    answer for one rollout and a wrong one for the other), and one batch of the first task goes
    through `GRPOTrainer._generate_and_score_completions` (reset, tool parsing and execution,
    tool-result masking, the reward). Prints what TRL logged and asserts it."""
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    import lookup_env as le

    torch.set_num_threads(args.threads)
    rows = le.rows(1, args.lookup_kind, args.difficulty)
    row = rows[0]
    stem = row["prompt"][1]["content"].split("the number in ")[1].split("?")[0]
    config = GRPOConfig(output_dir=str(Path(args.out) / "trainer"), num_generations=2,
                        per_device_train_batch_size=2, max_completion_length=args.max_turns * (args.max_tokens + 64),
                        generation_kwargs={"max_new_tokens": args.max_tokens},
                        max_tool_calling_iterations=args.max_turns - 1, max_steps=1, use_cpu=True,
                        report_to="none", shuffle_dataset=False)
    tok = lookup_tokenizer(args.model, args.chat_template)
    trainer = GRPOTrainer(model=args.model, reward_funcs=le.reward, args=config, train_dataset=Dataset.from_list(rows),
                          processing_class=tok, environment_factory=le.LookupEnv)
    call = '<tool_call>\n{"name": "bash", "arguments": {"command": "cat %s"}}\n</tool_call><|im_end|>' % stem
    seen: list[str] = []
    answers: list[str] = []

    def fake_generate(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):  # noqa: ANN001, ANN202
        out = []  # one reply a prompt: without vLLM, TRL's batch already repeats each prompt
        for ids in prompt_ids:
            text = tok.decode(ids)
            seen.append(text)
            if "<tool_response>" in text.rsplit("<|im_start|>assistant", 1)[0].rsplit("<|im_start|>", 1)[-1]:
                answers.append(row["answer"] if not answers else "99")
                reply = answers[-1] + "<|im_end|>"
            else:
                reply = call
            out.append(tok.encode(reply, add_special_tokens=False))
        return out, None

    trainer._generate_single_turn = fake_generate  # type: ignore[method-assign]
    trainer.model.train()
    output = trainer._generate_and_score_completions([dict(row), dict(row)])
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if k.startswith(("rewards/", "tools/"))}
    mask = output["tool_mask"].tolist()
    tool_tokens = [m.count(0) for m in mask]
    print(f"trl tool loop: {len(seen)} generate calls; tool result of the first: "
          f"{seen[-1].rsplit('<tool_response>', 1)[-1].split('</tool_response>')[0]!r}; "
          f"masked tool tokens per rollout {tool_tokens}; {metrics}", flush=True)
    assert metrics["tools/call_frequency"] == 1.0 and metrics["tools/failure_frequency"] == 0.0
    assert metrics["rewards/lookup_exact_match/mean"] == 0.5 and all(n > 0 for n in tool_tokens)
    assert f"exit code 0\n{row['answer']}\n" in seen[-1]
    print("trl tool loop: ok", flush=True)


def render_lookup_demos(args: argparse.Namespace) -> None:
    """`--render-lookup-demos IN OUT`: the token ids TRL's multi-turn loop feeds the model for each
    demonstration in IN (JSON list of {"prompt": [system, user], "replies": [text, ...],
    "tool_results": [text, ...]}: reply i, then tool result i when there is one), computed with
    TRL's own code as `train_lookup` sets it up: the prompt as `_generate` renders it (the row's
    messages with `LookupEnv.bash` as the tool, generation prompt on), each reply's ids as the
    model would sample them (SmolLM2's tokenizer, the reply text then EOS), each tool result's ids
    as `_tool_call_loop` appends them (`GRPOTrainer._get_tool_suffix_ids`). Writes OUT: per demo
    {"ids": [...], "mask": [...]} with mask 1 on the replies' ids (what TRL trains on) and 0 on
    the prompt's and tool results'."""
    from types import SimpleNamespace

    from trl import GRPOTrainer
    from trl.chat_template_utils import get_training_chat_template, is_chat_template_prefix_preserving

    import lookup_env as le

    tok = lookup_tokenizer(args.model, args.chat_template)
    tools = [le.LookupEnv().bash]
    template = None if is_chat_template_prefix_preserving(tok) else get_training_chat_template(tok)  # as GRPOTrainer
    fake = SimpleNamespace(processing_class=tok, chat_template=template, chat_template_kwargs={}, _is_vlm=False,
                           _tokenizer=tok)
    out = []
    for demo in json.loads(Path(args.render_lookup_demos[0]).read_text()):
        ids = list(tok.apply_chat_template(conversation=[demo["prompt"]], tools=tools, chat_template=template,
                                           add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"][0])
        mask = [0] * len(ids)
        for i, reply in enumerate(demo["replies"]):
            reply_ids = tok.encode(reply, add_special_tokens=False) + [tok.eos_token_id]
            ids, mask = ids + reply_ids, mask + [1] * len(reply_ids)
            if i < len(demo["tool_results"]):
                suffix = GRPOTrainer._get_tool_suffix_ids(
                    fake, [{"role": "tool", "name": "bash", "content": demo["tool_results"][i]}])
                ids, mask = ids + list(suffix), mask + [0] * len(suffix)
        out.append({"ids": ids, "mask": mask})
    Path(args.render_lookup_demos[1]).write_text(json.dumps(out))


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
    p.add_argument("--task", default="larger", choices=["larger", "lookup"])
    p.add_argument("--max-turns", type=int, default=3, help="lookup: most model calls a rollout")
    p.add_argument("--lookup-kind", default="lookup", choices=["lookup", "lookup_count", "lookup_json"])
    p.add_argument("--difficulty", type=int, default=1)
    p.add_argument("--chat-template", default="auto", choices=["auto", "own", "qwen2.5"],
                   help="lookup: the template TRL renders with (module docstring)")
    p.add_argument("--check-tool-loop", action="store_true", help="lookup: run TRL's tool loop on one batch "
                   "with fixed replies instead of sampling, and check its tool call, result, mask and reward")
    p.add_argument("--render-lookup-demos", nargs=2, metavar=("IN", "OUT"), help="lookup: write the ids TRL's "
                   "tool loop feeds the model for the demonstrations in IN (bench/tool_warmstart.py)")
    args = p.parse_args()
    if args.render_lookup_demos:
        sys.path.insert(0, str(Path(__file__).parent))
        render_lookup_demos(args)
        return
    if args.setup:
        print(setup())
        return
    if args.check_tool_loop:
        sys.path.insert(0, str(Path(__file__).parent))
        check_tool_loop(args)
        return
    train(args)


if __name__ == "__main__":
    main()
