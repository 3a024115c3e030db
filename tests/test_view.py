"""`harnessrl view`: the index (byte offsets, summaries, torn lines), the per-rollout payload
rebuilt with the samples builder, the static report's files, and serving over loopback HTTP."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from harnessrl.hooks import Hooks
from harnessrl.train.samples import build_rows
from harnessrl.types import Rollout, Trace, Turn
from harnessrl.view.detail import rollout_detail
from harnessrl.view.index import build_index, index_json
from harnessrl.view.report import write_report
from harnessrl.view.server import ViewServer


def _turn(i: int, prompt: list[int], completion: list[int], **kw) -> Turn:
    lps = kw.pop("lps", [-0.25] * len(completion))
    return Turn(turn_index=i, request={"messages": [{"role": "user", "content": f"message {i}"}]},
                response={"choices": [{"message": {"role": "assistant", "content": f"reply {i}"}}]},
                prompt_ids=prompt, completion_ids=completion, completion_logprobs=lps, policy_version=0, **kw)


def _rollout(tokenizer, rid: str, group: int, reward: float) -> Rollout:
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    a = enc("<|im_start|>system\n" + "You are a careful agent that solves tasks step by step. " * 4 + "<|im_end|>\n")
    c0, c1 = enc("I will look.") + [2], enc("Now I answer.") + [2]
    p1 = a + c0 + enc("\n<|im_start|>user\nobservation one<|im_end|>\n<|im_start|>assistant\n")
    p2 = p1 + c1[:2] + enc(" rewritten<|im_end|>\n<|im_start|>assistant\n")  # diverges inside c1
    turns = [_turn(0, a, c0), _turn(1, p1, c1), _turn(2, p2, enc("Done.") + [2]),
             _turn(3, p2, [], status="error", error="upstream 500"),
             _turn(4, p2, [5, 6], lps=[-0.1])]  # two ids, one logprob: unfaithful
    return Rollout(rollout_id=rid, group_id=group, task_id=f"task/{group}", harness="test", status="ok",
                   reward=reward, trace=Trace(session_id="s-" + rid, turns=turns))


@pytest.fixture
def run_dir(tmp_path: Path, tokenizer) -> Path:
    d = tmp_path / "run"
    d.mkdir()
    (d / "config.toml").write_text('[engine]\nmodel = "tiny-random"\n[train]\ngroups_per_step = 1\n')
    lines = [_rollout(tokenizer, f"r{k}", k // 2, float(k % 2)).model_dump_json() for k in range(4)]
    (d / "rollouts.jsonl").write_text(lines[0] + "\n" + lines[1] + "\n" + '{"torn": \n' + "\n".join(lines[2:]) + "\n")
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward_mean": 0.5, "samples/frac_clean": 0.25 * s}) + "\n"
                                             for s in (1, 2)))
    return d


def test_index_offsets_steps_and_torn_lines(run_dir: Path) -> None:
    index = build_index(run_dir)
    assert index.bad_lines == 1
    assert [s["rollout_id"] for s in index.summaries] == ["r0", "r1", "r2", "r3"]
    assert [s["step"] for s in index.summaries] == [1, 1, 2, 2]
    assert [s["advantage"] is not None and round(s["advantage"], 3) for s in index.summaries] == [-1.0, 1.0, -1.0, 1.0]
    assert index.summaries[0]["error_turns"] == 1 and index.summaries[0]["turns"] == 5
    assert index.read(2).rollout_id == "r2"
    assert [m["step"] for m in index.metrics] == [1, 2]
    with pytest.raises(IndexError, match="rollout 9"):
        index.read(9)


def test_detail_rows_are_the_builders_rows(run_dir: Path, tokenizer) -> None:
    index = build_index(run_dir)
    d = rollout_detail(index, 1, tokenizer, Hooks())
    rows, stats = build_rows(index.read(1))
    assert [r["ids"] for r in d["rows"]] == [list(r.input_ids) for r in rows]
    assert [r["trained_ids"] for r in d["rows"]] == [[t for t, m in zip(r.input_ids, r.completion_mask) if m] for r in rows]
    assert all(r["advantage"] == pytest.approx(1.0, abs=1e-4) for r in d["rows"])
    turns = {t["turn_index"]: t for t in d["turns"]}
    assert turns[0]["merge"] == "start" and turns[1]["merge"] == "clean"
    assert turns[2]["merge"] in ("realign", "fork")  # diverges inside turn 1's reply
    assert turns[3]["excluded"] == "error" and turns[3]["error"] == "upstream 500"
    assert turns[4]["excluded"] == "unfaithful"
    assert "len(completion_ids)=2 != len(completion_logprobs)=1" in turns[4]["unfaithful_reason"]
    assert turns[1]["reply"] == "reply 1" and turns[1]["messages"][0]["text"] == "message 1"
    segs = [s for r in d["rows"] for s in r["segments"]]
    assert {s["turn_index"] for s in segs} == {0, 1, 2}
    clean = next(s for s in segs if s["turn_index"] == 1)
    t0 = index.read(1).trace.turns[0]
    assert clean["context_start"] == len(t0.prompt_ids) + len(t0.completion_ids)
    assert d["stats"] == stats.as_metrics()
    assert d["vocab"][str(2)] == "<|im_end|>"
    # where turn 2's prompt left turn 1's ids: 2 ids into turn 1's reply (the builder's row metadata)
    t1 = index.read(1).trace.turns[1]
    where = {"turn_index": 2, "position": len(t1.prompt_ids) + 2}
    assert [dv for r in d["rows"] for dv in r["divergences"]] == [where]


def _tool_loop_rollout(tokenizer) -> Rollout:
    """Three agent turns of a tool loop: look (`cat fig.txt`, output 57), answer (`echo 57 >
    answer.txt`, no output), done; each request carries the whole conversation so far."""
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    calls = ["cat fig.txt", "echo 57 > answer.txt"]
    outputs = ["Output: 57", "Output: (none)"]
    replies = [f"<tool_call>{c}</tool_call>" for c in calls] + ["Done: 57."]
    messages = [{"role": "system", "content": "You run one shell command per reply."},
                {"role": "user", "content": "What is the number in fig.txt? Write it to answer.txt."}]
    prompt = enc("<|im_start|>system\nYou run one shell command per reply.<|im_end|>\n<|im_start|>user\n"
                 "What is the number in fig.txt? Write it to answer.txt.<|im_end|>\n<|im_start|>assistant\n")
    turns = []
    for i, reply in enumerate(replies):
        completion = enc(reply) + [2]
        turns.append(Turn(turn_index=i, request={"messages": [dict(m) for m in messages]},
                          reply={"content": reply}, prompt_ids=list(prompt), completion_ids=completion,
                          completion_logprobs=[-0.5] * len(completion), policy_version=0,
                          notes=[] if i == 0 else [f"bridged_from={i - 1}"]))
        if i < len(calls):
            messages += [{"role": "assistant", "content": reply},
                         {"role": "tool", "tool_call_id": f"call_{i}", "content": outputs[i]}]
            prompt = prompt + completion + enc(f"\n<|im_start|>tool\n{outputs[i]}<|im_end|>\n<|im_start|>assistant\n")
    return Rollout(rollout_id="loop", group_id=0, task_id="lookup/0", harness="test", status="ok", reward=1.0,
                   trace=Trace(session_id="s-loop", turns=turns))


def test_a_multi_turn_rollout_shows_turns_tool_outputs_and_trained_tokens_in_order(tmp_path: Path, tokenizer) -> None:
    d = tmp_path / "loop-run"
    d.mkdir()
    (d / "config.toml").write_text('[engine]\nmodel = "tiny-random"\n')
    rollout = _tool_loop_rollout(tokenizer)
    (d / "rollouts.jsonl").write_text(rollout.model_dump_json() + "\n")
    detail = rollout_detail(build_index(d), 0, tokenizer, Hooks())
    turns, (row,) = detail["turns"], detail["rows"]  # bridged turns merge CLEAN: one row
    assert [t["turn_index"] for t in turns] == [0, 1, 2]
    assert [t["merge"] for t in turns] == ["start", "clean", "clean"] and [t["row"] for t in turns] == [0, 0, 0]
    # each turn shows what is new since the previous call: the reply it replays, then the tool's output
    assert [[m["role"] for m in t["messages"]] for t in turns] == [["system", "user"], ["assistant", "tool (call_0)"],
                                                                   ["assistant", "tool (call_1)"]]
    assert [t["messages"][-1]["text"] for t in turns[1:]] == ["Output: 57", "Output: (none)"]
    assert [t["reply"] for t in turns] == ["<tool_call>cat fig.txt</tool_call>", "<tool_call>echo 57 > answer.txt</tool_call>",
                                           "Done: 57."]
    completions = [t.completion_ids for t in rollout.trace.turns]
    assert [t["trained_tokens"] for t in turns] == [len(c) for c in completions]
    # the row's trained ids are the three completions in turn order, each tool output between as context
    assert row["trained_ids"] == [i for c in completions for i in c]
    segs = row["segments"]
    assert [s["turn_index"] for s in segs] == [0, 1, 2]
    assert all(a["completion_end"] <= b["context_start"] < b["completion_start"] for a, b in zip(segs, segs[1:]))
    ids, mask = row["ids"], row["mask"]
    for s, out in zip(segs[1:], ["Output: 57", "Output: (none)"]):
        assert not any(mask[s["context_start"]:s["completion_start"]])
        assert out in tokenizer.decode(ids[s["context_start"]:s["completion_start"]])
        assert all(mask[s["completion_start"]:s["completion_end"]])
    assert detail["stats"]["samples/frac_bridged"] == 1.0 and detail["stats"]["samples/rows_per_rollout"] == 1.0


def test_report_files(run_dir: Path, tokenizer, tmp_path: Path) -> None:
    out = tmp_path / "report"
    done = write_report(build_index(run_dir), out, tokenizer, Hooks())
    assert done["rollouts"] == 4
    assert sorted(p.name for p in (out / "rollouts").iterdir()) == ["0.js", "1.js", "2.js", "3.js"]
    page = (out / "index.html").read_text()
    # no CDN: nothing loaded from elsewhere (the SVG namespace URI is a name, not a fetch)
    assert re.search(r"(src|href)\s*=\s*[\"']?https?:|@import|url\(https?:|<script src|<link", page) is None
    assert set(re.findall(r"https?://[^\"' ]+", page)) <= {"http://www.w3.org/2000/svg"}
    body = (out / "rollouts" / "1.js").read_text()
    assert body.startswith("hrlRollout(1, ") and body.rstrip().endswith(");")
    payload = json.loads(body[len("hrlRollout(1, "):body.rstrip().rindex(")")])
    assert payload["summary"]["rollout_id"] == "r1"
    assert [dv["turn_index"] for r in payload["rows"] for dv in r["divergences"]] == [2]
    assert "diverges from the previous turn's ids at position" in page, "the rollout page shows it"


def test_index_carries_the_runs_matplotlib_curve(run_dir: Path) -> None:
    import base64
    import io

    from PIL import Image

    assert index_json(build_index(run_dir))["curve_png"] is None  # no reward or held-out series
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in [
        {"step": 0, "eval/pass_rate": 0.25, "eval/tasks": 4.0, "eval/k": 2.0, "eval/pass_at_k": 0.5},
        {"step": 1, "reward/verifier_mean": 0.5}, {"step": 2, "reward/verifier_mean": 0.75}]))
    png = base64.b64decode(index_json(build_index(run_dir))["curve_png"])
    img = Image.open(io.BytesIO(png))
    img.load()
    assert img.format == "PNG" and img.size == (800, 450) and len(png) > 20_000


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_serves_index_and_one_rollout_over_loopback(run_dir: Path, tokenizer) -> None:
    index = build_index(run_dir)
    server = ViewServer(index, tokenizer, Hooks(), port=0).start()
    try:
        assert server.url.startswith("http://127.0.0.1:")
        code, body = _get(server.url + "api/index.json")
        assert code == 200
        got = json.loads(body)
        assert [r["rollout_id"] for r in got["rollouts"]] == ["r0", "r1", "r2", "r3"]
        assert "offset" not in got["rollouts"][0] and got["metrics"][1]["samples/frac_clean"] == 0.5
        code, body = _get(server.url + "api/rollout/2.json")
        assert code == 200
        assert json.loads(body) == json.loads(json.dumps(rollout_detail(index, 2, tokenizer, Hooks())))
        code, page = _get(server.url)
        assert code == 200 and b'data-mode="server"' in page
        assert _get(server.url + "api/rollout/17.json")[0] == 404
        assert _get(server.url + "etc/passwd")[0] == 404
    finally:
        server.close()


def test_not_a_run_dir_is_a_clear_error(tmp_path: Path) -> None:
    from harnessrl.errors import ConfigError

    with pytest.raises(ConfigError, match="no rollouts.jsonl"):
        build_index(tmp_path)


def test_cli_writes_report(run_dir: Path, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from harnessrl.cli import app

    out = tmp_path / "cli-report"
    result = CliRunner().invoke(app, ["view", str(run_dir), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "indexed 4 rollouts, 2 steps" in result.output and "(1 unreadable lines skipped)" in result.output
    assert (out / "index.html").is_file() and len(list((out / "rollouts").iterdir())) == 4


def test_cli_serves_on_loopback_and_prints_the_url(run_dir: Path) -> None:
    import os
    import subprocess
    import sys

    exe = Path(sys.executable).with_name("harnessrl")
    proc = subprocess.Popen([str(exe), "view", str(run_dir), "--port", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        url = None
        for _ in range(5):
            line = proc.stdout.readline()
            if line.startswith("serving "):
                url = line.split(" at ", 1)[1].split(" ", 1)[0]
                break
        assert url is not None and url.startswith("http://127.0.0.1:"), proc.stderr.read() if proc.poll() is not None else url
        code, body = _get(url + "api/index.json")
        assert code == 200 and len(json.loads(body)["rollouts"]) == 4
        code, body = _get(url + "api/rollout/0.json")
        assert code == 200 and json.loads(body)["summary"]["rollout_id"] == "r0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_a_turn_the_train_turn_fn_rejects_is_named_as_such(run_dir: Path, tokenizer) -> None:
    """A run whose `train_turn_fn` keeps every turn as context: each main turn says
    `train_turn_fn`, and the rollout's reason is the filter, not its group's rewards (before:
    nothing on the turns, and "zero-variance group" or nothing on the rollout)."""
    hooks = Hooks(train_turn_fn=lambda turn: False)
    detail = rollout_detail(build_index(run_dir), 0, tokenizer, hooks)
    assert detail["rows"] == []
    main = [t for t in detail["turns"] if t["main"]]
    assert main and [t["excluded"] for t in main] == ["train_turn_fn"] * len(main)
    assert [t["excluded"] for t in detail["turns"] if not t["main"]] == ["error", "unfaithful"]
    assert detail["dropped_by_trainer"] == f"no row to train: hooks.train_turn_fn kept {len(main)} turns as context only"
    kept = rollout_detail(build_index(run_dir), 0, tokenizer, Hooks(train_turn_fn=lambda turn: turn.turn_index != 0))
    assert [t["excluded"] for t in kept["turns"]][:3] == ["train_turn_fn", None, None]
    assert kept["rows"] and kept["dropped_by_trainer"] is None


def test_a_record_holding_a_nan_reward_is_unscored_in_the_index(tmp_path: Path, tokenizer) -> None:
    """A rollout written with reward NaN (before the runner refused one) reads as unscored; its
    group's other rollouts still get their advantages (before: `reward nan is not finite`)."""
    d = tmp_path / "run"
    d.mkdir()
    (d / "config.toml").write_text('[engine]\nmodel = "tiny-random"\n')
    rewards = [1.0, float("nan"), 0.0]
    (d / "rollouts.jsonl").write_text("".join(_rollout(tokenizer, f"r{k}", 0, r).model_dump_json() + "\n"
                                              for k, r in enumerate(rewards)))
    index = build_index(d)
    assert [s["advantage"] is not None and round(s["advantage"], 3) for s in index.summaries] == [1.0, False, -1.0]


def test_a_trained_rows_tokens_carry_the_loss_weight_and_flags_the_trainer_recorded(run_dir: Path, tokenizer) -> None:
    """The trainer's `token_weights.jsonl` record of a row lands on that row (matched by its ids'
    key and trained-token count, the last record winning); a record of other ids does not."""
    from harnessrl.loss.token_weights import append_token_weights, row_key

    rows, _ = build_rows(build_index(run_dir).read(1))
    row = rows[0]
    n = row.num_trained_tokens
    w = [round(0.5 + k / 100, 3) for k in range(n)]
    key = row_key(row.input_ids)
    append_token_weights(run_dir, 1, [{"rollout_id": "r1", "row_key": key, "n": n, "w": [1.0] * n,
                                       "clipped": [], "bounded": []}])
    append_token_weights(run_dir, 2, [
        {"rollout_id": "r1", "row_key": key, "n": n, "w": w, "clipped": [1], "bounded": [0, n - 1]},
        {"rollout_id": "r1", "row_key": key ^ 1, "n": n, "w": [9.0] * n, "clipped": [], "bounded": []},
        {"rollout_id": "r0", "row_key": key, "n": n, "w": [7.0] * n, "clipped": [], "bounded": []}])
    d = rollout_detail(build_index(run_dir), 1, tokenizer, Hooks())
    assert d["rows"][0]["weights"] == {"step": 2, "w": w, "clipped": [1], "bounded": [0, n - 1]}
    assert all(r["weights"] is None for r in d["rows"][1:])
    assert rollout_detail(build_index(run_dir), 2, tokenizer, Hooks())["rows"][0]["weights"] is None  # r2
