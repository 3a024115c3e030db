"""The lookup side-by-side's task and tool (`bench/lookup_env.py`): TRL's environment and
harnessrl's procedural task agree on the tasks, the tool's result and the verifier's outcome."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import lookup_env as le  # noqa: E402

from harnessrl.rewards.exact_match import ExactMatchVerifier  # noqa: E402
from harnessrl.tasks.procedural import ProceduralSource  # noqa: E402
from harnessrl.train.evaluation import EVAL_SEED_OFFSET  # noqa: E402


def test_rows_are_harnessrls_tasks_in_order() -> None:
    src = ProceduralSource(kinds=["lookup"], answer_via="reply")
    rows = le.rows(6)
    for k, row in enumerate(rows):
        task = src.get(k)
        assert row["prompt"] == [{"role": "system", "content": task.system_prompt},
                                 {"role": "user", "content": task.instruction}]
        assert json.loads(row["workspace"]) == task.workspace and len(task.workspace) == 3
        assert (row["answer"], row["answer_kind"], row["task_id"]) == (
            task.hidden_tests["answer"], "int", task.task_id)
        assert task.instruction.endswith("Reply with only the number.")
    assert le.HELD_OUT_OFFSET == EVAL_SEED_OFFSET
    held = le.rows(4, seed_offset=le.HELD_OUT_OFFSET)
    assert {r["task_id"] for r in held}.isdisjoint(r["task_id"] for r in le.rows(1000))
    assert le.rows(2, kind="lookup_json", difficulty=2)[0]["task_id"].startswith("procedural/lookup_json/")


def test_environment_tool_reads_the_workspace_and_reset_replaces_it() -> None:
    env = le.LookupEnv()
    rows = le.rows(2)
    assert env.reset(**rows[0]) is None
    task = ProceduralSource(kinds=["lookup"], answer_via="reply").get(0)
    stem = task.metadata["question"].split("the number in ")[1].rstrip("?")
    assert env.bash(f"cat {stem}") == f"exit code 0\n{task.hidden_tests['answer']}\n"
    assert env.bash("ls").splitlines()[1:] == sorted(task.workspace)
    assert env.bash("cat nothing.txt").startswith("exit code 1\ncat: nothing.txt: No such file")
    env.reset(**rows[1])
    assert env.bash("ls").splitlines()[1:] == sorted(json.loads(rows[1]["workspace"]))
    assert le.run_bash("sleep 5", Path("."), timeout_s=0.2).startswith("exit code -9 (timed out)\n")
    assert len(le.run_bash("yes | head -c 10000", Path("."))) == le.MAX_TOOL_OUTPUT_CHARS


@pytest.mark.parametrize("text", ["42", " 42\n", "`42`", "The answer is 42", "4 2", "", None, "looking\n42",
                                  "40 + 2 = 42", "042", "43"])
def test_reward_is_the_exact_match_verifiers_outcome(text: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    import harnessrl.rewards.exact_match as em

    monkeypatch.setattr(em, "read_submission", lambda *_: None)  # no answer.txt: the final answer is scored
    task = dataclasses.replace(ProceduralSource(kinds=["lookup"], answer_via="reply").get(3),
                               hidden_tests={"answer": "42", "answer_kind": "int"})
    expected = asyncio.run(ExactMatchVerifier().score(task, None, text)).value  # type: ignore[arg-type]
    completion = [{"role": "assistant", "content": "",
                   "tool_calls": [{"type": "function", "function": {"name": "bash", "arguments": {"command": "ls"}}}]},
                  {"role": "tool", "name": "bash", "content": "exit code 0\n"},
                  {"role": "assistant", "content": text}]
    assert le.reward([completion], answer=["42"], answer_kind=["int"]) == [expected]


def test_final_answer_is_the_last_assistant_message() -> None:
    assert le.final_answer([{"role": "assistant", "content": "7"}, {"role": "tool", "content": "x"}]) == "7"
    assert le.final_answer([{"role": "assistant", "content": None}]) == ""
    assert le.final_answer([]) is None


def test_command_line_parses_the_lookup_flags() -> None:
    import learning

    args = learning.parse_args(["--task", "lookup", "--seeds", "0,1,2", "--max-turns", "2"])
    assert (args.task, args.seeds, args.max_turns, args.max_tokens, args.chat_template) == (
        "lookup", [0, 1, 2], 2, 48, "auto")
    assert learning.parse_args([]).max_tokens == 24
    # the lookup arm is training-bound: its trainer gets both cores' threads unless told
    assert (args.train_threads, learning.parse_args([]).train_threads) == (2, 1)
    assert learning.parse_args(["--task", "lookup", "--train-threads", "1"]).train_threads == 1
    with pytest.raises(SystemExit):
        learning.parse_args(["--task", "lookup", "--max-turns", "0"])
    assert learning.goal_met("lookup", {"harnessrl": 0.5, "trl": 0.5}, 0.6)
    assert not learning.goal_met("lookup", {"harnessrl": 0.4, "trl": 0.5}, 0.3)
    assert not learning.goal_met("lookup", {"harnessrl": 0.9, "trl": 0.5}, 0.61)
    assert not learning.goal_met("larger", {"harnessrl": 0.89, "trl": 0.5}, 0.5)


# --- the tool-calling warm start (bench/tool_warmstart.py) ---

import os  # noqa: E402
import subprocess  # noqa: E402

import tool_warmstart as tw  # noqa: E402

TRL_PYTHON = Path(os.environ.get("HARNESSRL_CACHE") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "harnessrl")) / "bench" / "trl-1.16.0" / "bin" / "python"


def test_demos_are_right_answers_of_tasks_neither_arm_trains_or_is_scored_on() -> None:
    demos = tw.demos(8)
    trained = {r["task_id"] for r in le.rows(le.SIZE)}
    held_out = {r["task_id"] for r in le.rows(le.SIZE, seed_offset=le.HELD_OUT_OFFSET)}
    src = le.source("lookup", 1, tw.DEMO_OFFSET)
    for k, demo in enumerate(demos):
        task = src.get(k)
        assert demo["task_id"] == task.task_id and demo["task_id"] not in trained | held_out
        assert demo["prompt"] == [{"role": "system", "content": task.system_prompt},
                                  {"role": "user", "content": task.instruction}]
        call, answer = demo["replies"]
        stem = task.metadata["question"].split("the number in ")[1].rstrip("?")
        assert call == '<tool_call>\n{"name": "bash", "arguments": {"command": "cat %s"}}\n</tool_call>' % stem
        assert demo["tool_results"] == [f"exit code 0\n{answer}\n"]
        assert le.outcome(answer, task.hidden_tests["answer"]) == 1.0
    assert len({d["task_id"] for d in demos}) == 8


class _DirSandbox:
    """The one sandbox method the white-box loop's `bash` uses, on a host directory."""

    def __init__(self, root: Path) -> None:
        self.root = root

    async def exec(self, cmd: str, timeout_s: float, env=None, cwd=None):  # noqa: ANN001, ANN201
        from harnessrl.sandbox.base import ExecResult

        proc = subprocess.run(["bash", "-c", cmd], cwd=self.root, capture_output=True, text=True, timeout=timeout_s)
        return ExecResult(returncode=proc.returncode, stdout=proc.stdout, stderr=proc.stderr, timed_out=False,
                          duration_s=0.0)


def test_harnessrl_rendering_is_what_the_white_box_loop_feeds_the_model(tokenizer, tmp_path: Path) -> None:
    """The demo's ids are, token for token, the prompts harnessrl's white-box loop (through the
    proxy's capture path, bridged) hands the engine when the model replies as the demo does,
    followed by the replies; its mask covers the replies' ids exactly."""
    from harnessrl.chat.layer import ChatLayer
    from harnessrl.harness.python_loop import WhiteBoxConfig, WhiteBoxHarness
    from harnessrl.proxy.capture import CaptureDeps
    from harnessrl.proxy.config import ProxyConfig
    from harnessrl.proxy.sessions import SessionStore
    from harnessrl.types import Endpoint

    from fakes import FakeEngine

    demo = tw.demos(1)[0]
    task = le.source("lookup", 1, tw.DEMO_OFFSET).get(0)
    eos = tokenizer.eos_token_id
    replies = [tokenizer.encode(r, add_special_tokens=False) + [eos] for r in demo["replies"]]
    engine = FakeEngine(completion_ids=lambda i: replies[i], eos_token_ids=(eos,))
    chat = ChatLayer(tokenizer, eos_token_ids=(eos,))
    store = SessionStore()
    harness = WhiteBoxHarness(CaptureDeps(engine, chat, ProxyConfig()), store,  # type: ignore[arg-type]
                              WhiteBoxConfig(tools=["bash"], max_turns=3))
    for rel, text in task.workspace.items():
        (tmp_path / rel).write_text(text)
    session = store.open("r")
    result = asyncio.run(harness.run(task, _DirSandbox(tmp_path), Endpoint(  # type: ignore[arg-type]
        base_url="http://127.0.0.1:9/v1", api_key=session.key, model="m"), timeout_s=30))
    assert result.final_answer == task.hidden_tests["answer"]
    assert len(engine.calls) == 2
    ids, mask = tw.harnessrl_ids(demo, ChatLayer(tokenizer))
    first, second = engine.calls[0][0], engine.calls[1][0]
    assert second[:len(first) + len(replies[0])] == first + replies[0]
    assert ids == second + replies[1]
    assert mask == [0] * len(first) + [1] * len(replies[0]) + [0] * (len(second) - len(first) - len(replies[0])) \
        + [1] * len(replies[1])


TRL_LOOP = r'''
import json, sys
sys.path.insert(0, sys.argv[1])
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer
import lookup_env as le, trl_arm
demo, model = json.loads(open(sys.argv[2]).read()), sys.argv[3]
tok = trl_arm.lookup_tokenizer(model, "auto")
row = {"prompt": demo["prompt"], "workspace": json.dumps(le.source("lookup", 1, int(sys.argv[4])).get(0).workspace),
       "answer": demo["replies"][-1], "answer_kind": "int", "task_id": demo["task_id"]}
config = GRPOConfig(output_dir=sys.argv[5], num_generations=2, per_device_train_batch_size=2,
                    max_completion_length=400, generation_kwargs={"max_new_tokens": 48},
                    max_tool_calling_iterations=2, max_steps=1, use_cpu=True, report_to="none", shuffle_dataset=False)
trainer = GRPOTrainer(model=model, reward_funcs=le.reward, args=config, train_dataset=Dataset.from_list([row]),
                      processing_class=tok, environment_factory=le.LookupEnv)
replies = [tok.encode(r, add_special_tokens=False) + [tok.eos_token_id] for r in demo["replies"]]
prompts = []
def fake_generate(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
    prompts.append([list(p) for p in prompt_ids])
    return [replies[len(prompts) - 1] for _ in prompt_ids], None
trainer._generate_single_turn = fake_generate
trainer.model.train()  # metrics under "train", as in a training step
out = trainer._generate_and_score_completions([dict(row), dict(row)])
n = int(out["completion_mask"][0].sum())
print(json.dumps({"prompts": [p[0] for p in prompts], "completion": out["completion_ids"][0][:n].tolist(),
                  "tool_mask": out["tool_mask"][0][:n].tolist(), "reward": trainer._metrics["train"]["rewards/lookup_exact_match/mean"][-1]}))
'''


@pytest.mark.skipif(not TRL_PYTHON.exists(), reason="no TRL venv (bench/trl_arm.py --setup makes it)")
def test_trl_rendering_is_what_trls_tool_loop_feeds_the_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The TRL-rendered demo (`trl_arm.py --render-lookup-demos`) is, token for token, what
    TRL's own `GRPOTrainer` multi-turn loop with `LookupEnv` feeds the model when the model
    replies as the demo does (its `_generate_single_turn` replaced by the demo's replies): the
    first prompt, the second (prompt + call + tool result), then the answer; the mask is TRL's
    tool mask over the completion."""
    demo = tw.demos(1)[0]
    (tmp_path / "demo.json").write_text(json.dumps(demo))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1", "TQDM_DISABLE": "1"}
    loop = subprocess.run([str(TRL_PYTHON), "-c", TRL_LOOP, str(tw.BENCH), str(tmp_path / "demo.json"),
                           str(tiny_model_dir), str(tw.DEMO_OFFSET), str(tmp_path / "trainer")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert loop.returncode == 0, loop.stderr[-3000:]
    seen = json.loads(loop.stdout.strip().splitlines()[-1])
    (ids, mask), = tw.trl_ids([demo], tiny_model_dir)
    first, second = seen["prompts"]
    assert seen["reward"] == 1.0  # the tool ran on the task's workspace and the answer scored
    assert ids == second + seen["completion"][len(second) - len(first):]
    assert ids == first + seen["completion"] and mask == [0] * len(first) + seen["tool_mask"]
    # the two arms' renderings differ only in the tool's schema line of the system message
    from harnessrl.chat.layer import ChatLayer
    from harnessrl.engine.model_store import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    h_ids, h_mask = tw.harnessrl_ids(demo, ChatLayer(tok))
    h_text, t_text = tok.decode(h_ids), tok.decode(ids)
    assert h_text != t_text and h_text.rsplit("</tools>", 1)[1] == t_text.rsplit("</tools>", 1)[1]
    assert h_text.split("<tools>\n{")[0] == t_text.split("<tools>\n{")[0]
    assert [t for t, m in zip(h_ids, h_mask) if m] == [t for t, m in zip(ids, mask) if m]


def test_examples_train_the_replies_and_the_answer_of_a_fraction(tiny_model_dir: Path) -> None:
    cfg = tw.Config(n_demos=8, answer_frac=0.25, renderings="harnessrl")
    data = tw.examples(cfg, tiny_model_dir)
    from harnessrl.engine.model_store import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    trained = [tok.decode([t for t, m in zip(ids, mask) if m]) for ids, mask in data]
    demos = tw.demos(8)
    full = [d["replies"][0] + "<|im_end|>" + d["replies"][1] + "<|im_end|>" for d in demos]
    call_only = [d["replies"][0] + "<|im_end|>" for d in demos]
    assert sum(t == f for t, f in zip(trained, full)) == 2
    assert sum(t == c for t, c in zip(trained, call_only)) == 6
    assert data == tw.examples(cfg, tiny_model_dir)  # deterministic


def test_warm_start_is_built_once_per_config_and_deterministic(tiny_model_dir: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HARNESSRL_CACHE", str(tmp_path / "cache"))
    cfg = tw.Config(n_demos=4, batch_size=2, lr=1e-3, renderings="harnessrl")
    path = tw.warm_start(tiny_model_dir, cfg)
    assert path.parent == tmp_path / "cache" / "bench" and (path / "tokenizer.json").exists()
    meta = json.loads((path / "warmstart.json").read_text())
    assert meta["steps"] == 2 and meta["last_loss"] != meta["first_loss"]
    weights = (path / "model.safetensors").read_bytes()
    assert weights != (tiny_model_dir / "model.safetensors").read_bytes()
    monkeypatch.setattr(tw, "train", lambda *a, **k: pytest.fail("a built warm start is rebuilt"))
    assert tw.warm_start(tiny_model_dir, cfg) == path
    monkeypatch.undo()
    monkeypatch.setenv("HARNESSRL_CACHE", str(tmp_path / "cache"))
    again = tw.train(cfg, tiny_model_dir, tmp_path / "again")
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == weights and again["last_loss"] == meta["last_loss"]
    assert tw.config_hash(dataclasses.replace(cfg, answer_frac=0.4), tiny_model_dir) != tw.config_hash(cfg, tiny_model_dir)


def test_lookup_starts_from_the_warm_start_by_default() -> None:
    import learning

    assert learning.parse_args(["--task", "lookup"]).warm_start is True
    assert learning.parse_args(["--task", "lookup", "--no-warm-start"]).warm_start is False
    assert learning.parse_args([]).warm_start is False
    with pytest.raises(SystemExit):
        learning.parse_args(["--warm-start"])


# --- the held-out evaluation and the per-seed processes (bench/learning.py) ---


def test_held_out_runs_the_white_box_harness_on_the_held_out_tasks(tiny_model_dir: Path) -> None:
    import learning

    args = learning.parse_args(["--task", "lookup", "--eval-prompts", "2", "--eval-samples", "2", "--max-tokens", "8"])
    greedy = asyncio.run(learning._eval_lookup(tiny_model_dir, args, 1, samples=1, temperature=0.0))
    again = asyncio.run(learning._eval_lookup(tiny_model_dir, args, 1, samples=1, temperature=0.0))
    sampled = asyncio.run(learning._eval_lookup(tiny_model_dir, args, 1, samples=2, temperature=1.0))
    held = [r["task_id"] for r in le.rows(2, seed_offset=le.HELD_OUT_OFFSET)]
    assert sorted(r.task_id for r in greedy) == sorted(held)
    assert sorted(r.task_id for r in sampled) == sorted(held * 2)
    for r in greedy + sampled:
        assert r.harness == "white_box" and r.status == "ok" and r.reward == 0.0, (r.status, r.error)
        assert r.trace.turns and all(len(t.completion_ids) <= 8 for t in r.trace.turns)
    # greedy is top-k 1 at temperature 1, enforced by the proxy, and repeats exactly
    assert {(t.sampling.top_k, t.sampling.temperature) for r in greedy for t in r.trace.turns} == {(1, 1.0)}
    assert {(t.sampling.top_k, t.sampling.temperature) for r in sampled for t in r.trace.turns} == {(0, 1.0)}
    ids = {r.task_id: [t.completion_ids for t in r.trace.turns] for r in greedy}
    assert ids == {r.task_id: [t.completion_ids for t in r.trace.turns] for r in again}
    scores = asyncio.run(learning.held_out_lookup(tiny_model_dir, args, 1))
    assert (scores["pass"], scores["sampled_pass"], scores["errors"]) == (0.0, 0.0, 0.0)
    assert scores["mean_completion_tokens"] == sum(len(t.completion_ids) for r in greedy for t in r.trace.turns) / 2


def test_each_seed_runs_in_a_process_of_its_own_with_the_same_flags(tmp_path: Path) -> None:
    import learning

    argv = ["--task", "lookup", "--seeds", "0,1,2", "--out", "/x", "--steps=6", "--seed=4", "--base-scores", "b"]
    child = learning.child_argv(argv, 1, tmp_path / "seed-1", tmp_path / "base.json")
    assert child == ["--task", "lookup", "--steps=6", "--seed", "1", "--out", str(tmp_path / "seed-1"),
                     "--base-scores", str(tmp_path / "base.json")]
    args = learning.parse_args(child)
    assert (args.seed, args.seeds, args.steps, args.base_scores) == (1, [], 6, tmp_path / "base.json")
    (tmp_path / "learning.json").write_text(json.dumps({"args": {"steps": "6", "lr": "5e-05", "bf16": "harnessrl"}}))
    (tmp_path / "seed-2").mkdir()
    rec = learning.recorded_args(tmp_path / "seed-2", learning.parse_args(["--task", "lookup"]))
    assert (rec.steps, rec.lr, rec.bf16, rec.seed, rec.eval_prompts) == (6, 5e-05, "harnessrl", 2, 64)
    with pytest.raises(SystemExit):
        learning.parse_args(["--rescore", "d"])  # a --task lookup option
