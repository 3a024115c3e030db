"""A supervised warm start on recorded traces (`harnessrl sft`): the model learns the replies of
demonstrations before RL starts.

Responsibility: turn rollouts (`rollouts.jsonl`, e.g. recorded through a real agent and the
real proxy with a scripted policy: `engine.kind = "scripted"`) into examples, token ids with a
loss mask, through the samples builder RL uses (`train/samples.build_rows`: the same rows, the
same CLEAN / REALIGN / FORK merging, so the prompts are token for token what the agent sent and
only the replies' ids are in the loss); fine-tune a model on them (`fine_tune`) and save it as a
checkpoint the engine loads (`engine.model = <dir>`); measure the mean negative log-likelihood
of the examples' trained tokens (`examples_nll`). `bench/tool_warmstart.py` trains its
hand-rendered demonstrations with the same `fine_tune`.

The loss is the token mean of the next-token cross-entropy over the batch's trained ids
(maximum likelihood on the demonstrations' replies), AdamW at a constant learning rate.

What it does not do: record demonstrations (`harnessrl rollout` with a scripted engine), or
pick which rollouts are demonstrations beyond their reward (`min_reward`).
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from harnessrl.errors import ConfigError
from harnessrl.train.samples import build_rows
from harnessrl.train.step import autocast_context
from harnessrl.types import Rollout

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

Example = tuple[list[int], list[int]]
"""(token ids, loss mask): mask 1 where the id is a reply id to learn."""

TOKENIZER_FILES = ("tokenizer", "chat_template", "special_tokens", "generation_config")
"""Name prefixes of the base model's files copied beside the fine-tuned weights."""


@dataclass(frozen=True)
class SftSettings:
    """How `fine_tune` trains."""

    lr: float = 1e-4
    """AdamW learning rate (constant)."""
    epochs: int = 1
    """Passes over the examples (each in a seeded shuffled order)."""
    batch_size: int = 8
    """Examples per optimizer step (padded to the longest)."""
    seed: int = 0
    """Seeds torch (initialisation, dropout) and the order of the examples."""
    autocast: str = "off"
    """`train.step.autocast_context`: "off" or a mixed-precision dtype name."""

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.epochs < 1 or self.batch_size < 1:
            raise ConfigError(f"sft: lr={self.lr} must be > 0, epochs={self.epochs} and "
                              f"batch_size={self.batch_size} >= 1")


def demonstration_examples(rollouts: Iterable[Rollout], min_reward: float = 1.0) -> list[Example]:
    """The training rows (`build_rows`) of the rollouts with `reward >= min_reward`, as
    (ids, mask); rows with no trained id are left out.

    Returns:
        One example per row, in the rollouts' order.
    """
    out: list[Example] = []
    for rollout in rollouts:
        if rollout.reward is None or rollout.reward < min_reward:
            continue
        rows, _ = build_rows(rollout)
        out.extend((list(r.input_ids), list(r.completion_mask)) for r in rows)
    return out


def read_rollouts(paths: Sequence[Path]) -> list[Rollout]:
    """Every rollout of the `rollouts.jsonl` files (or run directories holding one) in `paths`.

    Raises:
        ConfigError: a path that is neither, or a line that is not a rollout (file and line named).
    """
    rollouts: list[Rollout] = []
    for path in paths:
        file = path / "rollouts.jsonl" if path.is_dir() else path
        if not file.is_file():
            raise ConfigError(f"--traces {path}: no such file (a rollouts.jsonl, or a directory holding one)")
        for lineno, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
            if line.strip():
                try:
                    rollouts.append(Rollout.model_validate_json(line))
                except ValueError as exc:
                    raise ConfigError(f"{file}:{lineno}: not a rollout: {str(exc)[:300]}") from exc
    return rollouts


def _batch(batch: Sequence[Example], pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids `[B, T]`, attention mask `[B, T]`, labels `[B, T]` (-100 where not trained)."""
    width = max(len(ids) for ids, _ in batch)
    ids = torch.tensor([i + [pad] * (width - len(i)) for i, _ in batch])
    attn = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i, _ in batch])
    labels = torch.tensor([[t if m else -100 for t, m in zip(i, mk, strict=True)] + [-100] * (width - len(i))
                           for i, mk in batch])
    return ids, attn, labels


def _nll(model: PreTrainedModel, ids: torch.Tensor, attn: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the trained positions (the head runs on those alone)."""
    hidden = model.get_decoder()(input_ids=ids, attention_mask=attn).last_hidden_state
    target = labels[:, 1:]
    picked = target != -100
    logits = model.get_output_embeddings()(hidden[:, :-1][picked]).float()
    return torch.nn.functional.cross_entropy(logits, target[picked])


def examples_nll(model: PreTrainedModel, examples: Sequence[Example], batch_size: int = 8) -> float:
    """Mean negative log-likelihood (nats a token) of the examples' trained ids under `model`
    (a transformers causal LM), token-weighted over all examples."""
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    total, count = 0.0, 0
    with torch.no_grad():
        for b in range(0, len(examples), batch_size):
            ids, attn, labels = _batch(examples[b:b + batch_size], pad)
            n = int((labels[:, 1:] != -100).sum())
            if n:
                total += float(_nll(model, ids, attn, labels)) * n
                count += n
    return total / count if count else float("nan")


def fine_tune(model_dir: Path, examples: Sequence[Example], out: Path, settings: SftSettings = SftSettings(),
              meta: dict[str, object] | None = None, meta_file: str = "sft.json") -> dict[str, object]:
    """Fine-tune the model in `model_dir` on `examples` and save it (weights in float32, the base
    model's tokenizer files) to `out`, written under `<out>.partial` and renamed when complete.

    Returns:
        What `out/<meta_file>` records: the settings, `examples`, `steps`, `first_loss`,
        `last_loss`, `train_s`, and `meta`.

    Raises:
        ConfigError: no example has a trained id.
    """
    from transformers import AutoModelForCausalLM  # lazy: transformers' import is slow

    if not any(any(mask) for _, mask in examples):
        raise ConfigError("sft: no example has a trained token (no demonstration passed min_reward?)")
    torch.manual_seed(settings.seed)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr)
    rng = random.Random(f"warmstart-order:{settings.seed}")
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    losses: list[float] = []
    t0 = time.monotonic()
    for _ in range(settings.epochs):
        order = list(range(len(examples)))
        rng.shuffle(order)
        for b in range(0, len(order), settings.batch_size):
            with autocast_context(model, settings.autocast):
                loss = _nll(model, *_batch([examples[i] for i in order[b:b + settings.batch_size]], pad))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            log.info("sft: step %d, loss %.3f, %.0f s", len(losses), losses[-1], time.monotonic() - t0)
    record: dict[str, object] = {"settings": asdict(settings), "base": str(model_dir), "examples": len(examples),
              "steps": len(losses), "first_loss": losses[0], "last_loss": losses[-1],
              "train_s": time.monotonic() - t0, **(meta or {})}
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    for f in model_dir.iterdir():  # the base model's own tokenizer and template
        if f.name.startswith(TOKENIZER_FILES):
            shutil.copy(f, tmp / f.name)
    (tmp / meta_file).write_text(json.dumps(record, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return record


def run_sft(traces: Sequence[Path], out: Path, model: str, settings: SftSettings = SftSettings(),
            min_reward: float = 1.0, threads: int = 1) -> dict[str, object]:
    """`harnessrl sft`: fine-tune `model` (a name `engine.model` accepts) on the demonstrations in
    `traces` (`rollouts.jsonl` files or run directories) and save it to `out`; the record also
    gives the examples' mean NLL (nats a token) before and after (`nll_before`, `nll_after`).

    Raises:
        ConfigError: unreadable traces, or no rollout with `reward >= min_reward`.
        ModelLoadError: `model` cannot be found.
    """
    from harnessrl.engine.model_store import resolve_model  # lazy: pulls in transformers
    from transformers import AutoModelForCausalLM  # lazy: transformers' import is slow

    torch.set_num_threads(threads)
    rollouts = read_rollouts(traces)
    examples = demonstration_examples(rollouts, min_reward)
    if not examples:
        raise ConfigError(f"sft: none of the {len(rollouts)} rollouts in {[str(p) for p in traces]} has "
                          f"reward >= {min_reward} (--min-reward)")
    model_dir = resolve_model(model)
    before = examples_nll(AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32), examples)
    record = fine_tune(model_dir, examples, out, settings, meta={"rollouts": len(rollouts), "nll_before": before})
    after = examples_nll(AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32), examples)
    record["nll_after"] = after
    (out / "sft.json").write_text(json.dumps(record, indent=1))
    return record
