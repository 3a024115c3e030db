"""`harnessrl doctor`: the template doctor on a model, and optionally one real rollout of a harness.

Responsibility: resolve the model as `engine.model` takes it and run the template doctor
(`train/template_doctor.py`: the probes, their findings and the exit-code rule) on its
tokenizer with the engine's EOS ids; with a harness, run one real rollout of the config
(`run_rollouts.run_evaluation`, group size 1) and add its merge figures to the report, a
problem when main-chain sampled tokens stay untrained.

What it does not do: the probes themselves (`train/template_doctor.py`) or check a running
vLLM server (`engine/vllm/doctor.py`, `harnessrl doctor --engine URL`).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from harnessrl.chat.layer import ChatLayer
from harnessrl.config import RunConfig
from harnessrl.engine.model_store import load_tokenizer, resolve_model
from harnessrl.hooks import load_hooks
from harnessrl.jsonl import read_jsonl
from harnessrl.run_rollouts import run_evaluation
from harnessrl.train.samples import build_rows
from harnessrl.train.template_doctor import (
    DoctorReport,
    diagnose_template,
    divergence_text,
)
from harnessrl.types import Rollout
from harnessrl.view.detail import merge_kinds, run_build_kwargs


def engine_eos_ids(model_dir: Path) -> tuple[int, ...] | None:
    """The EOS ids the engine stops on (the model's generation config), or None if unknown."""
    try:
        from transformers import GenerationConfig  # lazy: transformers, heavy; not needed at import

        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except Exception:  # noqa: BLE001 - no generation config: the caller falls back
        return None
    if eos is None:
        return None
    return tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))


def diagnose_model(model: str) -> DoctorReport:
    """`diagnose_template` on a model name as `engine.model` takes it (resolved offline).

    Raises:
        ModelError / ConfigError: the model cannot be resolved or has no tokenizer.
    """
    model_dir = resolve_model(model)
    return diagnose_template(load_tokenizer(model_dir), model=model, engine_eos=engine_eos_ids(model_dir))


def diagnose_rollout(cfg: RunConfig, report: DoctorReport) -> None:
    """Run one real rollout of `cfg`'s harness (group size 1) and add its merge figures to
    `report` (`report.rollout`; a problem when main-chain sampled tokens stay untrained)."""
    cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"group_size": 1})})
    with tempfile.TemporaryDirectory(prefix="harnessrl-doctor-") as tmp:
        run_evaluation(cfg, Path(tmp), limit=1)
        rows = read_jsonl(Path(tmp) / "rollouts.jsonl").rows
    if not rows:
        report.problems.append(f"the {cfg.harness.kind} rollout produced no rollout")
        return
    rollout = Rollout.model_validate(rows[0])
    kwargs = run_build_kwargs(cfg, load_hooks(cfg.hooks))
    _, stats = build_rows(rollout, **kwargs)
    eligible, is_main, kinds = merge_kinds(rollout, kwargs)
    sampled = sum(len(t.completion_ids) for t, m in zip(eligible, is_main) if m)
    trained_main = stats.tokens_trained
    untrained = max(0, sampled - trained_main)
    example = ""
    tok = load_tokenizer(resolve_model(cfg.engine.model))
    chat = ChatLayer(tok, encode_cache_tokens=0)
    for j, kind in enumerate(kinds):
        if kind in ("realign", "fork") and j > 0:
            prev = eligible[j - 1]
            example = f"turn {eligible[j].turn_index} {kind.upper()} " + divergence_text(
                chat, [*prev.prompt_ids, *prev.completion_ids], eligible[j].prompt_ids)
            break
    fr = stats.fractions()
    report.rollout = {"harness": cfg.harness.kind, "turns": len(rollout.trace.turns), "status": rollout.status,
                      "frac_clean": fr["clean"], "frac_realign": fr["realign"], "frac_fork": fr["fork"],
                      "sampled": sampled, "untrained_sampled_tokens": untrained, "example": example}
    if untrained:
        report.problems.append(f"{cfg.harness.kind} rollout: {untrained} of {sampled} main-chain sampled tokens untrained")
