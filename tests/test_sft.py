"""The warm start through the harness itself: a scripted policy behind the real proxy answers a
real agent (opencode) with the right tool calls in the model's own format, the recorded prompts
are the ids the policy was shown, and `harnessrl sft` on such rollouts lowers the NLL of their
reply tokens (tiny model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from harnessrl.cli import app
from harnessrl.config import RunConfig, check_training_config
from harnessrl.engine.scripted import ScriptedEngine
from harnessrl.errors import ConfigError, EngineError
from harnessrl.recipes.demos import TITLE, lookup_bash, tool_call
from harnessrl.train.samples import build_rows
from harnessrl.train.sft import demonstration_examples
from harnessrl.types import Rollout, Sampling, Trace, Turn

QUESTION = "What is the number in fig.txt? Write the answer to answer.txt."
TOOLS = "<tools>\n{...}\n</tools>"


def _prompt(*after: str) -> str:
    return (f"<|im_start|>system\nS\n{TOOLS}<|im_end|>\n<|im_start|>user\n{QUESTION}<|im_end|>\n"
            + "".join(after) + "<|im_start|>assistant\n")


def test_lookup_policy_reads_then_writes_then_answers() -> None:
    first = lookup_bash(_prompt())
    assert first == tool_call("bash", {"command": "cat fig.txt", "description": "Read fig.txt"})
    assert first.startswith('<tool_call>\n{"name": "bash", "arguments": {"command": "cat fig.txt"')
    called = f"<|im_start|>assistant\n{first}<|im_end|>\n"
    result = "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
    second = lookup_bash(_prompt(called, result))
    assert json.loads(second.split("\n")[1])["arguments"]["command"] == "echo 42 > answer.txt"
    wrote = f"<|im_start|>assistant\n{second}<|im_end|>\n<|im_start|>user\n<tool_response>\n\n</tool_response><|im_end|>\n"
    assert lookup_bash(_prompt(called, result, wrote)) == "42"
    assert lookup_bash("<|im_start|>user\nGenerate a title<|im_end|>\n") == TITLE  # no tools: a title call
    with pytest.raises(ValueError, match="no lookup question"):
        lookup_bash(f"{TOOLS} What is 2+2?")


async def test_the_scripted_engine_answers_in_the_models_ids(tokenizer: object) -> None:
    seen: list[str] = []
    engine = ScriptedEngine(tokenizer, lambda text: seen.append(text) or "hi there", max_context_tokens=64)  # type: ignore[arg-type, func-returns-value]
    prompt = tokenizer.encode("<|im_start|>user\nhello<|im_end|>\n")  # type: ignore[attr-defined]
    done = await engine.generate(prompt, Sampling(max_tokens=16))
    assert seen == [tokenizer.decode(prompt)]  # type: ignore[attr-defined]
    assert list(done.completion_ids) == [*tokenizer.encode("hi there", add_special_tokens=False),  # type: ignore[attr-defined]
                                         tokenizer.eos_token_id]  # type: ignore[attr-defined]
    assert done.completion_logprobs == (0.0,) * len(done.completion_ids) and done.finish_reason == "stop"
    cut = await engine.generate(prompt, Sampling(max_tokens=1))
    assert len(cut.completion_ids) == 1 and cut.finish_reason == "length"
    failing = ScriptedEngine(tokenizer, lambda text: 1 / 0, max_context_tokens=64)  # type: ignore[arg-type, return-value]
    with pytest.raises(EngineError, match="the scripted policy raised ZeroDivisionError"):
        await failing.generate(prompt, Sampling(max_tokens=4))


def test_a_scripted_engine_is_refused_for_training() -> None:
    cfg = RunConfig.model_validate({"engine": {"kind": "scripted"}})
    with pytest.raises(ConfigError, match="engine.kind = 'scripted' .* `harnessrl sft`"):
        check_training_config(cfg)


def _rollout(tokenizer: object, reward: float, rid: str) -> Rollout:
    """Two turns of a lookup demonstration as the proxy records them (the second extends the first)."""
    enc = tokenizer.encode  # type: ignore[attr-defined]
    eos = tokenizer.eos_token_id  # type: ignore[attr-defined]
    p0 = enc(_prompt())
    c0 = [*enc(tool_call("bash", {"command": "cat fig.txt"}), add_special_tokens=False), eos]
    p1 = p0 + c0 + enc("\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
                       add_special_tokens=False)
    c1 = [*enc("42", add_special_tokens=False), eos]
    turns = [Turn(turn_index=i, request={}, prompt_ids=p, completion_ids=c, completion_logprobs=[0.0] * len(c),
                  status="ok", policy_version=0) for i, (p, c) in enumerate([(p0, c0), (p1, c1)])]
    return Rollout(rollout_id=rid, group_id=0, task_id="lookup/0", harness="opencode", status="ok", reward=reward,
                   trace=Trace(session_id=rid, turns=turns))


def test_sft_learns_the_demonstrations_replies(tokenizer: object, tmp_path: Path) -> None:
    good, bad = _rollout(tokenizer, 1.0, "good"), _rollout(tokenizer, 0.0, "bad")
    [(ids, mask)] = demonstration_examples([good, bad])  # one CLEAN row; the failed rollout is no demonstration
    [row] = build_rows(good)[0]
    assert (ids, mask) == (list(row.input_ids), list(row.completion_mask))
    assert sum(mask) == len(good.trace.turns[0].completion_ids) + len(good.trace.turns[1].completion_ids)
    traces = tmp_path / "rollouts.jsonl"
    traces.write_text(good.model_dump_json() + "\n" + bad.model_dump_json() + "\n")
    out = tmp_path / "warm"
    result = CliRunner().invoke(app, ["sft", "--traces", str(traces), "--out", str(out), "--model", "tiny-random",
                                      "--lr", "3e-3", "--epochs", "8", "--batch-size", "1"])
    assert result.exit_code == 0, result.output
    record = json.loads((out / "sft.json").read_text())
    assert (record["rollouts"], record["examples"], record["steps"]) == (2, 1, 8)
    assert record["nll_after"] < record["nll_before"] - 2.0, record  # random weights: ~10.8 nats a token before
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    assert "mean NLL of their reply tokens" in result.output


def test_sft_without_a_demonstration_names_the_option(tokenizer: object, tmp_path: Path) -> None:
    traces = tmp_path / "rollouts.jsonl"
    traces.write_text(_rollout(tokenizer, 0.0, "bad").model_dump_json() + "\n")
    result = CliRunner().invoke(app, ["sft", "--traces", str(traces), "--out", str(tmp_path / "o"),
                                      "--model", "tiny-random"])
    assert result.exit_code == 2
    assert "none of the 1 rollouts" in result.output and "--min-reward" in result.output


@pytest.mark.agents
async def test_opencode_records_demonstrations_through_the_proxy(tokenizer: object, sandbox_root: Path) -> None:
    """Real opencode, real proxy, real sandbox, the lookup policy as the engine: the rollout
    passes by writing answer.txt through two bash calls, and every recorded prompt is exactly the
    ids the policy was shown (the prompts opencode's requests rendered to)."""
    from harnessrl.chat.layer import ChatLayer
    from harnessrl.harness.install import installed_agent_dirs, read_install_record
    from harnessrl.harness.opencode import OpencodeConfig, OpencodeHarness
    from harnessrl.hooks import tool_call_names
    from harnessrl.proxy.config import ProxyConfig, SamplingConfig
    from harnessrl.proxy.server import ProxyServer
    from harnessrl.rewards.exact_match import ExactMatchVerifier
    from harnessrl.rollout.runner import RolloutLimits, run_rollout
    from harnessrl.sandbox.local import LocalSandboxBackend, SandboxConfig
    from harnessrl.tasks.procedural import ProceduralSource

    if read_install_record("opencode") is None:
        pytest.skip("opencode is not installed (harnessrl harness install opencode)")
    shown: list[str] = []

    def policy(prompt: str) -> str:
        shown.append(prompt)
        return lookup_bash(prompt)

    engine = ScriptedEngine(tokenizer, policy, max_context_tokens=8192)  # type: ignore[arg-type]
    task = ProceduralSource(kinds=["lookup"], seed_offset=2_000_000).get(0)
    harness = OpencodeHarness(OpencodeConfig(context_tokens=8192, output_tokens=128, tools=["bash"],
                                             system_prompt="Run commands with the bash tool."))
    config = ProxyConfig(port=0, model_name="harnessrl-policy", sampling=SamplingConfig(max_tokens=128))
    async with ProxyServer(engine, ChatLayer(tokenizer), config) as proxy:  # type: ignore[arg-type]
        backend = LocalSandboxBackend(SandboxConfig(root_dir=sandbox_root), ro_binds=installed_agent_dirs(),
                                      proxy_port=proxy.port, proxy_socket=proxy.agent_socket_path)
        rollout = await run_rollout(task, 0, harness, backend, proxy, ExactMatchVerifier(),
                                    RolloutLimits(agent_timeout_s=170.0, verify_timeout_s=30.0))
    assert rollout.status == "ok" and rollout.reward == 1.0, (rollout.error, rollout.metadata["log_tail"][-500:])
    turns = rollout.trace.turns
    assert [tokenizer.decode(t.prompt_ids) for t in turns] == shown  # type: ignore[attr-defined]
    calls = [c for t in turns for c in tool_call_names(t)]
    assert calls == ["bash", "bash"]
    main = [t for t in turns if t.request.get("tools")]
    # opencode sent the calls back with their results: each later prompt extends the one before
    assert all(b.prompt_ids[:len(a.prompt_ids)] == a.prompt_ids for a, b in zip(main, main[1:]))
    assert [r.reply.content for r in main[-1:] if r.reply is not None] == [rollout.final_answer]
    assert len(demonstration_examples([rollout])) >= 1
