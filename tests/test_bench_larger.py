"""The learning benchmark's task (`bench/larger_task.py`), as both of its arms use it."""

from __future__ import annotations

import asyncio
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import larger_task as lt  # noqa: E402


def test_prompts_are_drawn_in_turn_from_the_seeded_generator() -> None:
    rng = random.Random("larger-1234")
    expected = [tuple(rng.sample(range(1, 100), 2)) for _ in range(5)]
    assert lt.pairs(lt.TRAIN_SEED, 5) == expected
    assert lt.pairs(lt.HELD_OUT_SEED, 64) != lt.pairs(lt.TRAIN_SEED, 64)
    a, b = expected[0]
    assert lt.prompt(a, b) == f"Which number is larger, {a} or {b}? Reply with only the number."
    task = lt.make_source().get(0)
    assert task.instruction == lt.prompt(a, b) and task.system_prompt is None
    assert task.hidden_tests["answer"] == max(a, b)


def test_rewards() -> None:
    assert lt.lenient("71 is larger than 12", 71) == 1.0 and lt.lenient("12 < 71", 71) == 0.0
    assert lt.strict(" 71\n", 71) == 1.0 and lt.strict("71.", 71) == 0.0
    assert [lt.format_aware(t, 71) for t in ("71", "71 is larger", "no")] == [1.0, 0.5, 0.0]
    reward = asyncio.run(lt.make_verifier("format_aware").score(lt.make_source().get(0), None, "oops"))
    assert reward.value == 0.0 and reward.parts == {"lenient": 0.0, "strict": 0.0}
