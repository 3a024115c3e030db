"""Each trained token's loss weight and clip / bound flags (`loss/token_weights.py`): recorded per
row from the packed micro-batches, by the trainer's step, written as `token_weights.jsonl`, and
read back by the viewer onto the row it belongs to."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from harnessrl.loss.losses import PpoClipLoss, loss_fn_for
from harnessrl.loss.token_weights import (MAX_TOKENS_PER_STEP, TokenWeightRecorder, append_token_weights,
                                          read_token_weights, row_key)
from harnessrl.train.policy import load_policy
from harnessrl.train.step import optimizer_step
from fakes import opposed_rows

torch.set_num_threads(1)


def test_row_key_is_the_crc_of_the_ids_and_tells_rows_apart() -> None:
    assert row_key([1, 2, 3]) == row_key((1, 2, 3))
    assert row_key([1, 2, 3]) != row_key([1, 2, 4]) and row_key([1, 2]) != row_key([1, 2, 0])
    assert row_key([]) == 0


def test_recorder_splits_a_pack_into_rows_in_row_order() -> None:
    # pack: row 1 (context, 2 trained), then row 0 (context, 3 trained)
    seq = torch.tensor([1, 1, 1, 0, 0, 0, 0])
    mask = torch.tensor([False, True, True, False, True, True, True])
    weight = torch.tensor([0.0, 1.23456, 0.5, 0.0, 2.0, 0.0, 1.0])
    clipped = torch.tensor([False, False, True, False, False, False, True])
    bounded = torch.tensor([False, False, False, False, True, True, False])
    rec = TokenWeightRecorder()
    rec.add([("a", [7, 8, 9, 10]), ("b", [4, 5, 6])], seq, mask, weight, clipped, bounded)
    assert rec.records == [
        {"rollout_id": "b", "row_key": row_key([4, 5, 6]), "n": 2, "w": [1.235, 0.5], "clipped": [1], "bounded": []},
        {"rollout_id": "a", "row_key": row_key([7, 8, 9, 10]), "n": 3, "w": [2.0, 0.0, 1.0], "clipped": [2],
         "bounded": [0, 1]},
    ]


def test_recorder_keeps_counts_only_past_its_bound() -> None:
    seq, mask = torch.tensor([0, 0, 0, 1, 1, 1]), torch.ones(6, dtype=torch.bool)
    flags = torch.tensor([True, False, False, True, True, False])
    rec = TokenWeightRecorder(max_tokens=4)
    rec.add([("a", [1]), ("b", [2])], seq, mask, torch.full((6,), 1e-4), flags, ~flags)
    assert rec.records[0]["w"] == [1e-4] * 3 and rec.records[0]["clipped"] == [0]
    assert rec.records[1]["w"] is None and rec.records[1]["clipped"] == 2 and rec.records[1]["bounded"] == 1
    assert MAX_TOKENS_PER_STEP >= 8192


def test_file_round_trip_by_rollout_and_a_torn_tail(tmp_path: Path) -> None:
    rec = {"rollout_id": "r1", "row_key": 5, "n": 1, "w": [0.9], "clipped": [], "bounded": [0]}
    append_token_weights(tmp_path, 3, [rec])
    append_token_weights(tmp_path, 4, [])
    with (tmp_path / "token_weights.jsonl").open("a") as fh:
        fh.write('{"rollout_id": "r2", "ro')
    assert read_token_weights(tmp_path) == {"r1": [{"step": 3, **rec}]}
    assert read_token_weights(tmp_path / "absent") == {}


@pytest.mark.parametrize("behaviour_weight", ["truncate", "mask"])
def test_the_step_records_every_trained_rows_token_weights(tiny_model_dir: Path, behaviour_weight: str) -> None:
    """The tiny random model gives each token ~1/vocab while the rows record logprob -2, so the
    behaviour weight `pi_prox / mu` is ~1e-4: kept as is by truncation (floor 0), masked (weight
    0, bounded) below `mask_low` 0.5."""
    policy = load_policy(tiny_model_dir, learning_rate=1e-3, weight_decay=0.0, lora_rank=0)
    rows = opposed_rows()
    result = optimizer_step(policy.model, policy.optimizer, rows,
                            loss_fn_for(PpoClipLoss(behaviour_weight=behaviour_weight)), temperature=1.0,
                            token_budget=40, max_grad_norm=1.0, policy_version=0)
    recs = result.token_weights
    assert sorted((r["rollout_id"], r["row_key"], r["n"]) for r in recs) == sorted(
        (row.rollout_id, row_key(row.input_ids), row.num_trained_tokens) for row in rows)
    weights = [w for r in recs for w in r["w"]]
    assert all(r["clipped"] == [] for r in recs)  # one step per batch: rho = 1, nothing clipped
    if behaviour_weight == "mask":
        assert weights == [0.0] * len(weights) and all(r["bounded"] == list(range(r["n"])) for r in recs)
    else:
        assert all(r["bounded"] == [] for r in recs) and all(0 < w < 0.01 for w in weights)
        mean = result.metrics["offpolicy/is_weight_mean"]
        assert sum(weights) / len(weights) == pytest.approx(mean, rel=1e-3)
        assert not math.isclose(mean, 1.0, abs_tol=0.5)

