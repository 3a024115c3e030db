"""The trainer on several processes (`train/distributed.py`, `train/step.py`): 2 gloo ranks on CPU
against one process on the same rows, for ddp and fsdp2.

Same loss (rel 1e-5), same gradient (max abs difference <= 1e-5 x the largest gradient entry)
and same weights after one AdamW step (max abs difference <= 1e-6, at lr 1e-3): the global
token normaliser and the world-size loss scale make 2 ranks sum exactly the gradient of one
process, up to float summation order. Also with one row for 2 ranks (rank 1 trains nothing and
joins the collectives with a zero-contribution pass).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch

from harnessrl.train.distributed import launched_ranks, split_by_tokens
from harnessrl.types import Row

LR = 1e-3
BUDGET = 96


def _rows(n: int = 5) -> list[Row]:
    """`n` rows of 24..72 tokens (a third of each trained), advantages alternating in sign."""
    rows = []
    for i in range(n):
        length = 24 + 12 * i
        ctx = length - length // 3
        ids = tuple(100 + (7 * i + 3 * t) % 900 for t in range(length))
        mask = tuple([0] * ctx + [1] * (length - ctx))
        lps = tuple([0.0] * ctx + [-3.0 - 0.1 * i] * (length - ctx))
        vers = tuple([-1] * ctx + [0] * (length - ctx))
        rows.append(Row(ids, mask, lps, vers, f"r{i}", 0, 1.0 if i % 2 == 0 else -0.5 - 0.1 * i))
    return rows


def _shared_rows() -> list[Row]:
    """Two groups of two rows, each group's rows sharing a 40-id prompt (packed once: a root and
    a branch); `split_by_tokens` puts each group on one rank of two."""
    rows = []
    for g, prompt_start in enumerate((100, 500)):
        prompt = tuple(prompt_start + (5 * t) % 300 for t in range(40))
        for k, length in enumerate((60, 50)):  # a root and its branch fit `BUDGET` (60 + 10 ids)
            own = tuple(200 + (11 * g + 7 * k + 3 * t) % 700 for t in range(length - 40))
            n_trained = length // 4
            mask = tuple([0] * (length - n_trained) + [1] * n_trained)
            lps = tuple(-2.5 - 0.1 * k if m else 0.0 for m in mask)
            vers = tuple(0 if m else -1 for m in mask)
            rows.append(Row(prompt + own, mask, lps, vers, f"g{g}r{k}", g, 1.0 if k == 0 else -1.0))
    return rows


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _run_case(model_dir: Path, rows: list[Row], ranks, lora_rank: int = 0) -> dict:
    """Gradient and loss of `rows`, then one optimizer step from the same weights."""
    from harnessrl.train.distributed import full_state_dict, inner_module
    from harnessrl.loss.losses import loss_fn_for
    from harnessrl.train.policy import load_policy
    from harnessrl.train.step import accumulate_gradients, optimizer_step

    torch.manual_seed(0)
    policy = load_policy(model_dir, learning_rate=LR, weight_decay=0.0, lora_rank=lora_rank, ranks=ranks)
    fn = loss_fn_for("ppo_clip")
    forwarded: list[int] = []  # ids through the input embeddings, this rank
    hook = policy.model.get_input_embeddings().register_forward_hook(lambda _m, a, _o: forwarded.append(a[0].numel()))
    acc = accumulate_gradients(policy.trained, rows, fn, temperature=1.0, token_budget=BUDGET, ranks=ranks)
    hook.remove()
    grads = {n: _full(p.grad) for n, p in inner_module(policy.trained).named_parameters() if p.requires_grad}
    result = optimizer_step(policy.trained, policy.optimizer, rows, fn, temperature=1.0, token_budget=BUDGET,
                            max_grad_norm=1e9, ranks=ranks, policy_version=1)
    weights = {k: v.clone() for k, v in full_state_dict(policy.trained, ranks).items()}
    return {"loss": acc.metrics["loss"], "tokens": acc.num_trained, "grads": grads, "weights": weights,
            "metrics": dict(result.metrics), "forwarded": sum(forwarded)}


def _resume_case(model_dir: Path, out_dir: Path, ranks) -> dict:
    """Step, checkpoint, step again; then a fresh policy restored from the checkpoint takes the
    same second step: the weights after it (rank 0) of both."""
    from harnessrl.engine.model_store import load_tokenizer
    from harnessrl.train.distributed import full_state_dict
    from harnessrl.loss.losses import loss_fn_for
    from harnessrl.train.policy import load_policy, restore_checkpoint, save_checkpoint
    from harnessrl.train.step import optimizer_step

    fn, rows = loss_fn_for("ppo_clip"), _rows()
    tokenizer = load_tokenizer(model_dir) if ranks.is_main else None

    def step(policy) -> None:
        optimizer_step(policy.trained, policy.optimizer, rows, fn, temperature=1.0, token_budget=BUDGET,
                       max_grad_norm=1e9, ranks=ranks)

    first = load_policy(model_dir, learning_rate=LR, weight_decay=0.0, lora_rank=0, ranks=ranks)
    step(first)
    save_checkpoint(first, tokenizer, out_dir / "ckpt", {"step": 1, "policy_version": 1})
    step(first)
    resumed = load_policy(model_dir, learning_rate=LR, weight_decay=0.0, lora_rank=0, ranks=ranks)
    state = restore_checkpoint(resumed, out_dir / "ckpt")
    step(resumed)
    return {"state": state, "continued": full_state_dict(first.trained, ranks),
            "resumed": full_state_dict(resumed.trained, ranks)}


def _worker(rank: int, world: int, port: int, strategy: str, lora_rank: int, model_dir: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from harnessrl.train.distributed import close_ranks, init_ranks

    ranks = init_ranks("cpu", strategy)
    try:
        many = _run_case(Path(model_dir), _rows(), ranks, lora_rank)
        if lora_rank:
            torch.save({"many": many}, Path(out_dir) / f"rank{rank}.pt")
            return
        one = _run_case(Path(model_dir), _rows(1), ranks)
        shared = _run_case(Path(model_dir), _shared_rows(), ranks)
        resume = _resume_case(Path(model_dir), Path(out_dir), ranks)
        torch.save({"many": many, "one": one, "shared": shared, "resume": resume}, Path(out_dir) / f"rank{rank}.pt")
    finally:
        close_ranks(ranks)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def single(tiny_model_dir: Path) -> dict:
    return {"many": _run_case(tiny_model_dir, _rows(), _single()), "one": _run_case(tiny_model_dir, _rows(1), _single()),
            "shared": _run_case(tiny_model_dir, _shared_rows(), _single())}


def _single():
    from harnessrl.train.distributed import SINGLE

    return SINGLE


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_ranks_equal_one_process(strategy: str, single: dict, tiny_model_dir: Path, tmp_path: Path) -> None:
    _check_two_ranks(strategy, 0, single, ("many", "one", "shared"), tiny_model_dir, tmp_path)
    # each rank forwarded its group's prompt once (37 ids a branch), as one process does
    whole = sum(len(r.input_ids) for r in _shared_rows())
    assert single["shared"]["forwarded"] == single["shared"]["metrics"]["tokens_packed"] == whole - 2 * 37
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)["shared"]
        assert got["metrics"]["tokens_packed"] == whole - 2 * 37
        assert got["forwarded"] == (whole - 2 * 37) // 2
    # a checkpoint of 2 ranks resumes to the same next step as the run that wrote it
    resume = torch.load(tmp_path / "rank0.pt", weights_only=False)["resume"]
    assert resume["state"] == {"step": 1, "policy_version": 1}
    assert (tmp_path / "ckpt" / "model.safetensors").exists()
    for name, w in resume["continued"].items():
        assert float((resume["resumed"][name] - w).abs().max()) <= 1e-6, name


def test_lora_on_two_ddp_ranks_equals_one_process(tiny_model_dir: Path, tmp_path: Path) -> None:
    """LoRA adapters under DDP: the same adapter gradients and the same merged weights."""
    single = {"many": _run_case(tiny_model_dir, _rows(), _single(), lora_rank=4)}
    assert all("lora_" in n for n in single["many"]["grads"])
    _check_two_ranks("ddp", 4, single, ("many",), tiny_model_dir, tmp_path)


def _check_two_ranks(strategy: str, lora_rank: int, single: dict, cases: tuple[str, ...], tiny_model_dir: Path,
                     tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(2, _free_port(), strategy, lora_rank, str(tiny_model_dir), str(tmp_path)), nprocs=2,
             join=True)
    for case in cases:
        ref = single[case]
        for rank in (0, 1):
            got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)[case]
            # every rank reports the whole step
            assert got["tokens"] == ref["tokens"]
            assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-7)
            assert got["metrics"]["tokens_trained"] == ref["metrics"]["tokens_trained"]
            assert got["metrics"]["grad_norm"] == pytest.approx(ref["metrics"]["grad_norm"], rel=1e-5)
            assert got["metrics"]["param_delta_l2"] == pytest.approx(ref["metrics"]["param_delta_l2"], rel=1e-4)
            assert got["metrics"]["ratio_abs_dev"] == pytest.approx(ref["metrics"]["ratio_abs_dev"], rel=1e-5)
            # the off-policy diagnostics are the whole step's (every row's tokens at staleness 1)
            assert got["metrics"]["offpolicy/s1/tokens"] == ref["metrics"]["offpolicy/s1/tokens"] == ref["tokens"]
            for key in ("offpolicy/is_weight_ess", "offpolicy/mismatch_kl", "offpolicy/is_weight_max"):
                assert got["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-5), key
            assert set(got["grads"]) == set(ref["grads"])
            scale = max(float(g.abs().max()) for g in ref["grads"].values())
            assert scale > 0
            for name, g in ref["grads"].items():
                diff = float((got["grads"][name] - g).abs().max())
                assert diff <= 1e-5 * scale, (case, rank, name, diff, scale)
        # full weights are gathered on rank 0 (fsdp2: the other rank holds none)
        weights = torch.load(tmp_path / "rank0.pt", weights_only=False)[case]["weights"]
        assert set(weights) == set(ref["weights"])
        for name, w in ref["weights"].items():
            assert float((weights[name] - w).abs().max()) <= 1e-6, (case, name)
        if strategy == "fsdp2":
            assert torch.load(tmp_path / "rank1.pt", weights_only=False)[case]["weights"] == {}


def test_the_step_moves_the_weights(single: dict, tiny_model_dir: Path) -> None:
    """The reference case is not trivial: the step changes every trained tensor by about lr."""
    from safetensors.torch import load_file

    start = load_file(str(tiny_model_dir / "model.safetensors"))
    after = single["many"]["weights"]
    changed = [k for k in start if float((after[k] - start[k]).abs().max()) > 0.5 * LR]
    assert len(changed) >= len(start) - 1  # every tensor (the tied lm_head is the embedding)


def test_split_by_tokens_balances_whole_rows() -> None:
    assert split_by_tokens([10, 50, 30, 30, 20], 2) == [[1, 4], [0, 2, 3]]  # 70 vs 70
    assert split_by_tokens([5], 2) == [[0], []]
    assert split_by_tokens([], 3) == [[], [], []]
    parts = split_by_tokens(list(range(1, 40)), 3)
    assert sorted(i for p in parts for i in p) == list(range(39))
    loads = [sum(i + 1 for i in p) for p in parts]
    assert max(loads) <= sum(range(1, 40)) / 3 + 1  # 261 of 780
    with pytest.raises(ValueError, match="world_size=0"):
        split_by_tokens([1], 0)


def test_launched_ranks_reads_the_launcher_environment() -> None:
    from harnessrl.errors import ConfigError

    assert launched_ranks({}) == (0, 1, 0)
    assert launched_ranks({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}) == (1, 2, 1)
    with pytest.raises(ConfigError, match="RANK=2, WORLD_SIZE=2"):
        launched_ranks({"WORLD_SIZE": "2", "RANK": "2", "LOCAL_RANK": "0"})
    with pytest.raises(ConfigError, match="WORLD_SIZE='two'"):
        launched_ranks({"WORLD_SIZE": "two"})


def test_trainer_dtype_and_refused_combinations(tiny_model_dir: Path) -> None:
    from harnessrl.config import load_config
    from harnessrl.errors import ConfigError
    from harnessrl.train.distributed import Ranks, init_ranks
    from harnessrl.loss.losses import loss_fn_for
    from harnessrl.train.policy import load_policy
    from harnessrl.train.step import optimizer_step

    policy = load_policy(tiny_model_dir, learning_rate=LR, weight_decay=0.0, lora_rank=0, dtype="bfloat16")
    assert {p.dtype for p in policy.model.parameters()} == {torch.bfloat16}
    before = policy.model.model.embed_tokens.weight.detach().clone()
    m = optimizer_step(policy.trained, policy.optimizer, _rows(), loss_fn_for("ppo_clip"), temperature=1.0,
                       token_budget=BUDGET, max_grad_norm=1.0).metrics
    assert m["tokens_trained"] > 0 and "skipped" not in m
    assert not torch.equal(before, policy.model.model.embed_tokens.weight)
    with pytest.raises(ConfigError, match="train.dtype='float16'"):
        load_policy(tiny_model_dir, learning_rate=LR, weight_decay=0.0, lora_rank=0, dtype="float16")
    with pytest.raises(ConfigError, match="lora_rank > 0 with train.strategy='fsdp2'"):
        load_policy(tiny_model_dir, learning_rate=LR, weight_decay=0.0, lora_rank=4,
                    ranks=Ranks(rank=0, world_size=2, strategy="fsdp2"))
    with pytest.raises(ConfigError, match="train.strategy='zero3'"):
        init_ranks("cpu", "zero3", environ={})
    with pytest.raises(ConfigError, match="train.device='tpu'"):
        init_ranks("tpu", "ddp", environ={})
    assert init_ranks("cpu", "fsdp2", environ={}).distributed is False  # one process: no group
    cfg = load_config(None, ["train.strategy=fsdp2", "train.dtype=bfloat16"])
    assert (cfg.train.strategy, cfg.train.device, cfg.train.dtype) == ("fsdp2", "cpu", "bfloat16")
    with pytest.raises(Exception, match="strategy"):
        load_config(None, ["train.strategy=deepspeed"])


class _RecordingSync:
    """A `WeightSync` that keeps the bytes it was handed (rank 0)."""

    def __init__(self) -> None:
        self.published: list[int] = []

    def publish(self, policy, version: int):
        from harnessrl.engine.weight_sync import SyncReport
        from harnessrl.train.policy import export_weights

        weights = export_weights(policy)
        self.published.append(version)
        return SyncReport(version=version, seconds=0.0, bytes=sum(t.numel() * t.element_size() for t in weights.values()))


def _group_worker(rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from harnessrl.config import load_config, trainer_settings
    from harnessrl.engine.model_store import load_tokenizer
    from harnessrl.train.distributed import close_ranks, init_ranks, inner_module
    from harnessrl.train.trainer_group import TrainerGroup

    cfg = load_config(None, ["train.lora_rank=4", f"train.learning_rate={LR}", f"train.token_budget={BUDGET}"])
    ranks = init_ranks("cpu", "ddp")
    group = TrainerGroup(trainer_settings(cfg), ranks)
    try:
        if ranks.is_main:
            group.load(Path(model_dir))
            metrics = group.step(_rows()).metrics
            report = group.publish(_RecordingSync(), 1)
            group.save(load_tokenizer(Path(model_dir)), Path(out_dir) / "ckpt", {"step": 1, "policy_version": 1})
            group.step(_rows())
            group.stop()
            extra = {"metrics": metrics, "sync_bytes": report.bytes}
        else:
            group.follow()
            extra = {}
        state = {k: v.clone() for k, v in inner_module(group.policy.trained).state_dict().items()}
        torch.save({"state": state, **extra}, Path(out_dir) / f"group{rank}.pt")
    finally:
        close_ranks(ranks)


def test_trainer_group_keeps_lora_ranks_bit_identical(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Rank 0 drives load, step, publish, checkpoint, step, stop; rank 1 follows. Adapters and
    the frozen base end bit-identical on both ranks (rank 0's exports for the sync and the
    checkpoint merge the adapters out of place, leaving its base weights as they were)."""
    import torch.multiprocessing as mp

    mp.spawn(_group_worker, args=(2, _free_port(), str(tiny_model_dir), str(tmp_path)), nprocs=2, join=True)
    zero, one = (torch.load(tmp_path / f"group{r}.pt", weights_only=False) for r in (0, 1))
    assert zero["metrics"]["tokens_trained"] == sum(r.num_trained_tokens for r in _rows())
    assert zero["sync_bytes"] > 0
    assert (tmp_path / "ckpt" / "adapter").is_dir() and (tmp_path / "ckpt" / "model.safetensors").exists()
    assert set(zero["state"]) == set(one["state"])
    assert any("lora_" in k for k in zero["state"])
    for name, value in zero["state"].items():
        assert torch.equal(value, one["state"][name]), name
