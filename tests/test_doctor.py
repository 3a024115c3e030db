"""`harnessrl doctor`: template probes on the real SmolLM2 template and on templates carried
here (a Qwen3-style thinking template that strips reasoning from history; one that renders
tool-call arguments as a JSON string), the CLI's exit codes, and a real white-box rollout."""

from __future__ import annotations

import copy

import pytest
from typer.testing import CliRunner

from harnessrl.cli import app
from harnessrl.train.template_doctor import _bridge_fn, diagnose_template
from harnessrl.chat.layer import ChatLayer, normalize_messages
from harnessrl.errors import RequestError

# Qwen3-style: the generation prompt opens the reasoning block; an earlier assistant turn is
# re-rendered with its reasoning stripped (everything up to `</think>` dropped).
QWEN3_STYLE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{%- set content = message.content or '' %}"
    "{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
)

# Renders tool-call arguments by string concatenation: it expects them as a JSON string.
ARGS_AS_STRING = (
    "{%- if tools %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}{{- '<|im_start|>assistant\\n' }}"
    "{%- for tc in message.tool_calls %}"
    "{{- '<tool_call>\\n{\"name\": \"' + tc.function.name + '\", \"arguments\": ' + tc.function.arguments + '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _with_template(tokenizer, template: str):
    tok = copy.copy(tokenizer)
    tok.chat_template = template
    return tok


def _by_probe(report):
    return {f.probe: f for f in report.findings}


def test_smollm2_template_findings(tokenizer) -> None:
    report = diagnose_template(tokenizer, model="tiny-random", engine_eos=[2])
    f = _by_probe(report)
    assert report.generation_prompt == "<|im_start|>assistant\n"
    assert report.end_of_turn == "<|im_end|>\n" and report.end_of_turn_id == 2
    assert report.engine_eos == {2: "<|im_end|>"}
    assert report.tool_roundtrip == "ok"
    for name in ("multi_turn", "trailing_whitespace", "tool_call", "content_parts"):
        assert f[name].kind == "clean" and f[name].untrained_sampled_tokens == 0, name
    # SmolLM2's template drops reasoning_content and re-tokenises the reply's text: the
    # next prompt diverges inside the sampled reply
    for name in ("non_canonical_ids", "reasoning"):
        assert f[name].kind in ("realign", "fork"), name
        assert "at token" in f[name].example
    assert "ids [" in f["non_canonical_ids"].example  # same text, other ids
    if _bridge_fn(ChatLayer(tokenizer)) is None:
        assert f["non_canonical_ids"].bridged == "bridging: not available"
        # the builder either untrains the reply (REALIGN) or keeps it in its own row (FORK)
        lost = any(x.untrained_sampled_tokens for x in report.findings)
        assert report.exit_code == int(lost)
        if lost:
            assert any(p.startswith("non_canonical_ids:") for p in report.problems)
        assert report.clean_fraction == pytest.approx(4 / 6)
    else:
        # bridged rendering reuses the sampled ids: every probe merges CLEAN
        assert f["non_canonical_ids"].bridged == "clean" and f["reasoning"].bridged == "clean"
        assert report.clean_fraction == 1.0
        assert report.exit_code == 0, report.problems


def test_end_of_turn_not_an_engine_eos_is_a_problem(tokenizer) -> None:
    report = diagnose_template(tokenizer, model="m", engine_eos=[0])  # <|endoftext|> only
    assert report.exit_code == 1
    assert any("not an EOS id of the engine" in p for p in report.problems)


def test_qwen3_style_thinking_template(tokenizer) -> None:
    tok = _with_template(tokenizer, QWEN3_STYLE)
    report = diagnose_template(tok, model="qwen3-style", engine_eos=[2])
    f = _by_probe(report)
    assert report.generation_prompt == "<|im_start|>assistant\n<think>\n"
    chat = ChatLayer(tok)
    reply = chat.encode("\n</think>\n\n" + '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>') + [2]
    if chat.parse(reply, True).tool_calls:  # the chat layer reads calls after a closed block
        assert report.tool_roundtrip == "ok"
    multi = f["multi_turn"]
    if multi.bridged != "clean":
        # the history drops the `<think>\n` the generation prompt opened: the next prompt
        # diverges before the reply, inside the earlier prompt (FORK; the reply still trains)
        assert multi.kind == "fork" and multi.untrained_sampled_tokens == 0
        assert "<think>" in multi.example
        assert any(w.startswith("multi_turn: turn 2 FORKs") for w in report.warnings)
    reasoning = f["reasoning"]
    if reasoning.bridged != "clean":
        # history is re-rendered without the reasoning the model sampled
        assert reasoning.kind in ("realign", "fork")
        assert "Add two" in reasoning.example
        assert report.exit_code == int(any(x.loses_tokens for x in report.findings) or bool(report.problems))
    parsed = chat.parse(chat.encode("Add two and two.\n</think>\n\n4") + [2], False)
    if parsed.reasoning is None:  # the chat layer does not split a reply the prompt opened
        assert report.reasoning_split.startswith("a <think> reply parses to content")
        assert any(w.startswith("reasoning:") for w in report.warnings)
    else:
        assert report.reasoning_split == "ok"


def test_tool_arguments_as_json_string_template(tokenizer) -> None:
    tok = _with_template(tokenizer, ARGS_AS_STRING)
    report = diagnose_template(tok, model="args-as-string", engine_eos=[2])
    tool = _by_probe(report)["tool_call"]
    chat = ChatLayer(tok)
    replay = normalize_messages([{"role": "user", "content": "u"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]}])
    try:
        chat.render(replay, [{"type": "function", "function": {"name": "f"}}])
        rejects = False
    except RequestError:
        rejects = True
    if rejects:
        assert tool.kind == "rejected" and "does not render" in tool.note
        assert report.tool_roundtrip.startswith("the template rejects the replayed call")
        assert report.exit_code == 1
        assert "tool_call: the template rejects the replayed conversation" in report.problems
    else:  # the chat layer gives this template the JSON string it expects
        assert tool.kind == "clean" and report.tool_roundtrip == "ok"


def test_cli_exit_code_and_report(tiny_model_dir) -> None:
    result = CliRunner().invoke(app, ["doctor", "--model", "tiny-random"])
    assert "generation prompt: '<|im_start|>assistant\\n'" in result.output
    assert "multi_turn" in result.output and "expected CLEAN fraction" in result.output
    from harnessrl.doctor import diagnose_model

    expected = diagnose_model("tiny-random").exit_code
    assert result.exit_code == expected, result.output
    assert ("PROBLEM:" in result.output) == (expected == 1)


def test_cli_unknown_model_is_a_clear_error() -> None:
    result = CliRunner().invoke(app, ["doctor", "--model", "/nonexistent/model-dir"])
    assert result.exit_code == 2
    assert "/nonexistent/model-dir" in result.output


@pytest.mark.e2e
def test_white_box_rollout_part(tmp_path, tiny_model_dir) -> None:
    from harnessrl.config import load_config
    from harnessrl.doctor import diagnose_model, diagnose_rollout

    report = diagnose_model("tiny-random")
    cfg = load_config(None, ["engine.model=\"tiny-random\"", "harness.kind=\"white_box\"", "sampling.max_tokens=16",
                             f"sandbox.root_dir=\"{tmp_path / 'sb'}\""])
    diagnose_rollout(cfg, report)
    r = report.rollout
    assert r is not None and r["harness"] == "white_box" and r["turns"] == 1
    assert 0 < r["sampled"] <= 16 and r["untrained_sampled_tokens"] == 0
    assert "rollout (white_box): 1 turns" in "\n".join(report.lines())


# -- `harnessrl doctor --engine URL` against small fake servers (the real server passes it in
# `tests/test_vllm_canary.py`)

def test_engine_doctor_says_what_is_wrong_with_a_server(tiny_model_dir) -> None:
    import threading
    from http.server import ThreadingHTTPServer

    from test_vllm_upstream import FakeVllm

    from harnessrl.engine.vllm.doctor import diagnose_engine

    unreachable = diagnose_engine("http://127.0.0.1:9", tiny_model_dir)
    assert [(c.name, c.ok) for c in unreachable.checks] == [("server", False)] and unreachable.exit_code == 1
    handler = type("Fake", (FakeVllm,), {"calls": [], "scales_temperature": False})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        report = diagnose_engine(url, tiny_model_dir)
        checks = {c.name: c for c in report.checks}
        assert list(checks) == ["server", "logprob mode", "temperature", "tied head", "canary"]
        assert checks["logprob mode"].ok, "its top_k=1 logprobs are processed"
        assert not checks["temperature"].ok and "does not scale its processed logprobs" in checks["temperature"].detail
        assert checks["tied head"].ok and "not readable here" in checks["tied head"].detail
        assert not checks["canary"].ok and "could not score the probe" in checks["canary"].detail
        assert report.exit_code == 1
        lines = "\n".join(report.lines())
        assert "PROBLEM temperature" in lines and "verdict: a run attached" in lines
        result = CliRunner().invoke(app, ["doctor", "--model", str(tiny_model_dir), "--engine", url])
        assert result.exit_code == 1 and "PROBLEM temperature" in result.output
    finally:
        server.shutdown()
        server.server_close()
