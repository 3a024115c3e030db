"""Time to accuracy: how much sooner async GRPO reaches the accuracy synchronous GRPO ends at.

One invocation trains, on the same task, model, learning rate, groups per step and step budget
(`bench/learning.py`'s settings and machinery: its task flags, `train_harnessrl`, its held-out
evaluations `held_out` / `held_out_lookup`, its TRL arm), these arms at each seed:

  * `sync`: `train.max_staleness = 0` (generation and training in turn);
  * `async-1`, `async-2`, `async-4`: `train.max_staleness` 1, 2, 4 with the loss's default;
  * `async-1-behaviour`: staleness 1 with the loss centred on the sampler's (behaviour)
    policy, `train.loss.clip_center=behaviour` (the loss before the decoupled objective; on code
    without that key, the only loss there is, run as is and labelled so);
  * `trl`: TRL's `GRPOTrainer` (`bench/trl_arm.py`, its own venv, made by `trl_arm.py --setup`).

Each arm runs in a process of its own (an arm's heap is returned to the machine when it exits)
and writes ARM/arm.json. A harnessrl arm saves a checkpoint every `--eval-every` steps
(`train.checkpoint_every`) and, once training ended, each checkpoint is scored by the held-out
evaluation: the intermediate ones sampled only (`--eval-samples` rollouts a task at temperature
1.0), the final one greedy and sampled. The time of checkpoint k is the training time through
step k: the sum of the loop's `time/step_s` over steps 1..k (rollout wait, update and weight
sync; neither the evaluations, which run afterwards, nor the checkpoint writes count). TRL's
arm is scored at its end only (its training seconds as TRL reports them).

Per arm and seed it prints the final held-out pass (greedy and sampled), the training time
(`train s`: the sum of `time/step_s`; `wall s`: the training call's whole wall time, start-up
and checkpoint writes included), the time at which it first reached `sync`'s final sampled pass
(`t sync-acc`), that time over `sync`'s training time, the largest clipped-token fraction of
any step (`clip_low_frac + clip_high_frac` of the step's one update, at the weights before it),
the process's peak RSS, and the seed's goal lines:
  (a) final sampled pass within 3 points of sync's (5 at staleness 4);
  (b) time to sync's accuracy <= 60% of sync's training time;
  (c) against TRL: sampled pass >= TRL's and training time <= 40% of TRL's;
  (d) no step with more than 2% of its tokens clipped.
A probe table per async arm follows (staleness, |r - 1|, clip fractions and groups whose
rollouts span policy versions, per step), from the arm's step metrics and `rollouts.jsonl`.

    .venv/bin/python bench/async_learning.py --task lookup --steps 6 --lr 5e-5 --bf16 harnessrl --seeds 0,1,2
    .venv/bin/python bench/async_learning.py --task lookup --steps 6 --lr 5e-5 --bf16 harnessrl --seeds 0 \\
        --arms sync,async-1-behaviour --eval-prompts 32             # a quick run
    .venv/bin/python bench/async_learning.py --task larger --steps 20 --lr 5e-5 --bf16 harnessrl --seeds 0,1,2
    .venv/bin/python bench/async_learning.py --report OUT            # the tables of an earlier OUT again
    .venv/bin/python bench/async_learning.py --task lookup --eval-prompts 32 --rescore OUT   # final checkpoints scored again

Every flag it does not know is `bench/learning.py`'s (the task, model, lr, steps, groups, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import learning  # noqa: E402


@dataclass(frozen=True)
class Arm:
    """A harnessrl arm: its staleness bound and its config overrides."""

    max_staleness: int
    sets: tuple[str, ...] = ()


BEHAVIOUR = "train.loss.clip_center=behaviour"
ARMS: dict[str, Arm | None] = {
    "sync": Arm(0),
    "async-1": Arm(1),
    "async-1-behaviour": Arm(1, (BEHAVIOUR,)),
    "async-2": Arm(2),
    "async-4": Arm(4),
    "trl": None,  # bench/trl_arm.py
}
DEFAULT_ARMS = ("sync", "async-1", "async-1-behaviour", "async-2", "async-4", "trl")
WITHIN_POINTS = {4: 0.05}
"""Goal (a)'s allowance by staleness (default 0.03)."""


def _arm_list(text: str) -> list[str]:
    names = [a.strip() for a in text.split(",") if a.strip()]
    unknown = [a for a in names if a not in ARMS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"--arms: unknown arm(s) {unknown or text!r}; known: {', '.join(ARMS)}")
    return names


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, argparse.Namespace]:
    """This script's flags, and `bench/learning.py`'s (every flag this one does not know, with
    `--dynamic-sampling 0` and `--eval-prompts 64` unless given)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", type=_arm_list, default=list(DEFAULT_ARMS),
                   help=f"comma-separated, run in this order per seed (default {','.join(DEFAULT_ARMS)}); "
                   "sync first, as every arm's time to accuracy is measured against its final sampled pass")
    p.add_argument("--seeds", type=learning._seed_list, default=[0], metavar="S1,S2,...")
    p.add_argument("--eval-every", type=int, default=2, help="steps between held-out evaluations "
                   "(checkpoints); the last step is always evaluated")
    p.add_argument("--arm-only", default=None, choices=list(ARMS), help=argparse.SUPPRESS)  # an arm's process
    p.add_argument("--seed", type=int, default=None, help=argparse.SUPPRESS)  # with --arm-only
    p.add_argument("--report", type=Path, default=None, metavar="OUT", help="print the tables of an earlier OUT")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--rescore", type=Path, default=None, metavar="OUT", help="score each harnessrl arm's "
                   "final checkpoint of an earlier OUT again (held-out greedy and sampled; the earlier "
                   "scores kept as held_out_before), then print the tables")
    own, rest = p.parse_known_args(argv)
    if own.eval_every < 1:
        p.error("--eval-every must be >= 1")
    for flag in ("--max-staleness",):
        if any(a == flag or a.startswith(flag + "=") for a in rest):
            p.error(f"{flag} is not an option here")
    if not any(a == "--dynamic-sampling" or a.startswith("--dynamic-sampling=") for a in rest):
        rest = [*rest, "--dynamic-sampling", "0"]
    bench = learning.parse_args(rest)
    if bench.harness != "white_box":
        p.error("--harness: time to accuracy runs the white-box harness only")
    return own, bench


# --- the arithmetic: time to accuracy and the goals ---


def cumulative_times(history: list[dict]) -> dict[int, float]:
    """{step: training seconds through that step}: the running sum of `time/step_s` over the
    steps (a step without it, or with NaN, adds 0)."""
    total, out = 0.0, {}
    for m in sorted((m for m in history if m.get("step", 0) > 0), key=lambda m: m["step"]):
        step_s = m.get("time/step_s", 0.0)
        total += step_s if isinstance(step_s, (int, float)) and math.isfinite(step_s) else 0.0
        out[int(m["step"])] = total
    return out


def time_to(curve: list[list[float]], target: float) -> float | None:
    """The first time in `curve` ([[step, seconds, sampled pass], ...], by step) whose pass is
    >= `target` (a 1e-9 tolerance for equal fractions); None when none is."""
    for _, seconds, passed in sorted(curve):
        if passed >= target - 1e-9:
            return seconds
    return None


def max_clip(history: list[dict]) -> float:
    """The largest `clip_low_frac + clip_high_frac` of any step that updated (0 without one)."""
    fracs = [m.get("clip_low_frac", 0.0) + m.get("clip_high_frac", 0.0) for m in history if "loss" in m]
    return max(fracs, default=0.0)


def goals(arm: str, r: dict, sync: dict | None, trl: dict | None) -> dict[str, bool | None]:
    """Goal lines (a)-(d) of `arm`'s result `r` against `sync`'s and `trl`'s (None: not
    measured); a goal that cannot be judged (no sync or TRL result), and every goal of sync and
    TRL themselves, is None."""
    spec = ARMS[arm]
    out: dict[str, bool | None] = {"a": None, "b": None, "c": None, "d": None}
    if spec is None or arm == "sync":
        return out
    sampled = r["held_out"]["sampled_pass"]
    if sync is not None:
        allowance = WITHIN_POINTS.get(spec.max_staleness, 0.03)
        out["a"] = sampled >= sync["held_out"]["sampled_pass"] - allowance - 1e-9
        t = r.get("time_to_sync")
        out["b"] = t is not None and t <= 0.6 * sync["train_s"]
    if trl is not None:
        out["c"] = sampled >= trl["held_out"]["sampled_pass"] - 1e-9 and r["train_s"] <= 0.4 * trl["train_s"]
    out["d"] = r["clip_max"] <= 0.02
    return out


def add_time_to_sync(results: dict[str, dict]) -> None:
    """Each arm's `time_to_sync` (`time_to` of sync's final sampled pass on its curve) and
    `ratio_to_sync` (over sync's training time), in place; nothing without a sync result."""
    sync = results.get("sync")
    if sync is None:
        return
    target = sync["held_out"]["sampled_pass"]
    for r in results.values():
        r["time_to_sync"] = time_to(r["curve"], target)
        r["ratio_to_sync"] = r["time_to_sync"] / sync["train_s"] if r["time_to_sync"] is not None else None


# --- one arm in its own process ---


def loss_label(sets: tuple[str, ...], bench_sets: list[str]) -> tuple[str, tuple[str, ...]]:
    """The loss an arm's overrides select (its `clip_center`, or `kind` when the loss has no
    such key) and the overrides that this code accepts: `train.loss.clip_center` where the loss
    has it; on code without it, the behaviour arm runs the only loss there is.

    Raises:
        ConfigError: an override of `--set` is invalid."""
    from harnessrl.config import load_config
    from harnessrl.errors import ConfigError

    try:
        cfg = load_config(None, [*bench_sets, *sets])
    except ConfigError:
        if BEHAVIOUR not in sets:
            raise
        cfg = load_config(None, bench_sets)
        sets = tuple(s for s in sets if s != BEHAVIOUR)
    loss = cfg.train.loss.model_dump()
    return str(loss.get("clip_center", f"{loss['kind']}, behaviour-centred (no clip_center key)")), sets


def run_arm(name: str, bench: argparse.Namespace, model_dir: Path, out: Path, eval_every: int) -> dict:
    """`name` at `bench.seed`, trained and scored in this process; writes and returns OUT/arm.json
    (held_out, train_s, wall_s, curve, clip_max, peak_rss_gb, load, loss, history, probe)."""
    out.mkdir(parents=True, exist_ok=True)
    spec = ARMS[name]
    load0 = os.getloadavg()[0]
    if spec is None:
        model, train_s, log = learning.trl_arm(bench, model_dir, out)
        scores = asyncio.run(learning.evaluate(model, bench))
        r = {"held_out": scores, "train_s": train_s, "wall_s": train_s,
             "curve": [[bench.steps, train_s, scores["sampled_pass"]]], "loss": "TRL GRPOTrainer",
             "clip_max": max((float(m.get("clip_ratio/region_mean", 0.0)) for m in log), default=0.0),
             "history": learning.jsonable(log), "probe": []}
    else:
        label, sets = loss_label(spec.sets, bench.set)
        bench.max_staleness = spec.max_staleness
        bench.set = [*bench.set, *sets, f"train.checkpoint_every={eval_every}"]
        train = learning.lookup_harnessrl_arm if bench.task == "lookup" else learning.harnessrl_arm
        final, wall_s, history = train(bench, out)
        times = cumulative_times(history)
        curve = []
        for step in sorted(times):
            ckpt = out / "checkpoints" / f"step-{step}"
            if ckpt == final or not (ckpt / "config.json").exists():
                continue
            curve.append([step, times[step], asyncio.run(sampled_pass(ckpt, bench))])
            shutil.rmtree(ckpt)  # its optimizer state alone is ~1 GB
        scores = asyncio.run(learning.evaluate(final, bench))
        (final / "trainer_state.pt").unlink(missing_ok=True)
        curve.append([bench.steps, times[max(times)], scores["sampled_pass"]])
        r = {"held_out": scores, "train_s": times[max(times)], "wall_s": wall_s, "curve": curve,
             "loss": label, "clip_max": max_clip(history), "history": learning.jsonable(history),
             "probe": probe(history, out / "rollouts.jsonl", bench.prompts_per_step)}
    r.update(arm=name, seed=bench.seed, peak_rss_gb=learning.peak_rss_gb(), load=[load0, os.getloadavg()[0]])
    (out / "arm.json").write_text(json.dumps(r, indent=1))
    return r


async def sampled_pass(model_dir: Path, bench: argparse.Namespace) -> float:
    """The held-out pass of `model_dir` over `--eval-samples` samples a task at temperature 1.0
    (the `sampled_pass` of `learning.evaluate`, without its greedy evaluation on lookup)."""
    if bench.task != "lookup":
        return (await learning.held_out(model_dir, bench.eval_prompts, threads=2, max_tokens=bench.max_tokens,
                                        samples=bench.eval_samples))["sampled_pass"]
    from harnessrl.rollout.summary import passed

    rollouts = await learning._eval_lookup(model_dir, bench, 2, samples=bench.eval_samples, temperature=1.0)
    return sum(map(passed, rollouts)) / len(rollouts)


def probe(history: list[dict], rollouts_file: Path, groups_per_step: int) -> list[dict]:
    """Per step: the verifier's mean reward, staleness mean / max, |r - 1| (`ratio_abs_dev`), clip fractions, `OFFPOLICY`, the
    step's group ids in the order they arrived, and the groups whose rollouts' turns span more
    than one policy version, with their reward mean (`rollouts.jsonl` holds each step's groups
    in turn, `groups_per_step` plus `groups_drawn_extra` a step)."""
    groups: list[tuple[int, set[int], list[float]]] = []  # (group id, versions, rewards), file order
    if rollouts_file.exists():
        for line in rollouts_file.read_text().splitlines():
            r = json.loads(line)
            versions = {t["policy_version"] for t in r["trace"]["turns"]}
            reward = r.get("train_reward", r.get("reward"))
            if not groups or groups[-1][0] != r["group_id"]:
                groups.append((r["group_id"], set(), []))
            groups[-1][1].update(versions)
            groups[-1][2].append(float(reward) if reward is not None else math.nan)
    rows, at = [], 0
    for m in sorted((m for m in history if m.get("step", 0) > 0), key=lambda m: m["step"]):
        n = groups_per_step + int(m.get("groups_drawn_extra", 0))
        mine, at = groups[at:at + n], at + n
        spanning = [g for g in mine if len(g[1]) > 1]
        rows.append({"step": m["step"], "reward_mean": m.get("reward/verifier_mean", math.nan),
                     "staleness_mean": m.get("staleness_mean", math.nan),
                     "staleness_max": m.get("staleness_max", math.nan), "ratio_abs_dev": m.get("ratio_abs_dev", math.nan),
                     "clip_low_frac": m.get("clip_low_frac", math.nan), "clip_high_frac": m.get("clip_high_frac", math.nan),
                     "groups": [g[0] for g in mine], "versions": [sorted(g[1]) for g in mine],
                     "spanning": len(spanning),
                     "spanning_reward_mean": [sum(g[2]) / len(g[2]) for g in spanning],
                     "skipped": bool(m.get("skipped")),
                     **{k: m.get(f"offpolicy/{k}", math.nan) for k in OFFPOLICY}})
    return rows


OFFPOLICY = ("lag/mismatch_kl", "lag/is_weight_mean", "lag/is_weight_ess", "clip_frac", "bounded_frac")
"""The loss's `offpolicy/*` step diagnostics the probe keeps (`loss/diagnostics.py`; NaN where
the code or the step has none: `lag/*` needs tokens at staleness >= 1)."""


# --- the tables ---


def _pct(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.1%}"


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def print_seed(seed: int, results: dict[str, dict]) -> dict[str, dict[str, bool | None]]:
    """The seed's table (arm rows) and goal lines; returns {arm: goals}."""
    sync, trl = results.get("sync"), results.get("trl")
    print(f"\nseed {seed}" + (f": sync's final sampled pass {_pct(sync['held_out']['sampled_pass'])} in "
                             f"{sync['train_s']:.0f} s is the target" if sync else ": no sync arm"))
    print(f"{'arm':18} {'loss':>10} {'greedy':>7} {'sampled':>7} {'train s':>7} {'wall s':>6} {'t sync-acc':>10} "
          f"{'/ sync':>6} {'clip max':>8} {'RSS GB':>6} {'load':>9}  curve (step: s, sampled)")
    verdicts = {}
    for arm, r in results.items():
        ratio = r.get("ratio_to_sync")
        curve = " ".join(f"{int(s)}: {t:.0f} {p:.0%}" for s, t, p in r["curve"])
        print(f"{arm:18} {r['loss'][:10]:>10} {_pct(r['held_out']['pass']):>7} {_pct(r['held_out']['sampled_pass']):>7} "
              f"{r['train_s']:7.0f} {r['wall_s']:6.0f} {_s(r.get('time_to_sync')):>10} "
              f"{'-' if ratio is None else f'{ratio:.2f}':>6} {r['clip_max']:8.4f} {r['peak_rss_gb']:6.1f} "
              f"{r['load'][0]:4.1f}-{r['load'][1]:<4.1f}  {curve}")
        verdicts[arm] = goals(arm, r, sync, trl)
    names = {"a": "sampled within 3 pts of sync (5 at staleness 4)", "b": "t to sync's accuracy <= 0.60 x sync",
             "c": "vs TRL: sampled >= and time <= 0.40 x", "d": "no step > 2% tokens clipped"}
    for arm, g in verdicts.items():
        if ARMS[arm] is not None and arm != "sync":
            print(f"goals {arm:18} " + "; ".join(
                f"({k}) {names[k]}: {'-' if v is None else 'met' if v else 'NOT met'}" for k, v in g.items()))
    return verdicts


def print_probe(seed: int, results: dict[str, dict]) -> None:
    """Per async arm and step: staleness, |r - 1|, clip fractions, groups and their versions."""
    for arm, r in results.items():
        if not r.get("probe") or ARMS[arm] is None or ARMS[arm].max_staleness == 0:  # type: ignore[union-attr]
            continue
        print(f"\nprobe, seed {seed}, {arm} ({r['loss']}): step, reward mean, staleness mean/max, |r-1|, clip low/high, "
              f"offpolicy lag KL / lag w mean / lag ESS / clip / bounded, groups (versions), spanning groups' "
              f"mean reward")
        for p in r["probe"]:
            p = {k: math.nan if v is None else v for k, v in p.items()}  # null in a metrics line
            groups = " ".join(f"{g}{v}" for g, v in zip(p["groups"], p["versions"]))
            print(f"  {p['step']:>3} {p.get('reward_mean', math.nan):4.2f} "
                  f"{p['staleness_mean']:4.2f}/{p['staleness_max']:<3.0f} {p['ratio_abs_dev']:8.2e} "
                  f"{p['clip_low_frac']:.4f}/{p['clip_high_frac']:.4f}  "
                  + " / ".join(f"{p.get(k, math.nan):.3g}" for k in OFFPOLICY) + f"  {groups}  "
                  f"{' '.join(f'{x:.2f}' for x in p['spanning_reward_mean']) or '-'}"
                  + ("  (skipped)" if p["skipped"] else ""))


def summary(runs: dict[int, dict[str, dict]]) -> None:
    """Per arm over the seeds: mean greedy and sampled pass, mean training time, mean ratio to
    sync, and the seeds meeting each goal."""
    arms = [a for a in ARMS if any(a in r for r in runs.values())]
    print(f"\n{'arm':18} {'seeds':>5} {'greedy':>7} {'sampled':>7} {'train s':>7} {'/ sync':>6}  goals met (a b c d)")
    for arm in arms:
        rs = [r[arm] for r in runs.values() if arm in r]
        ratios = [r["ratio_to_sync"] for r in rs if r.get("ratio_to_sync") is not None]
        met = {k: sum(bool(r.get("goals", {}).get(k)) for r in rs) for k in "abcd"}
        judged = {k: sum(r.get("goals", {}).get(k) is not None for r in rs) for k in "abcd"}
        print(f"{arm:18} {len(rs):5} {_pct(sum(r['held_out']['pass'] for r in rs) / len(rs)):>7} "
              f"{_pct(sum(r['held_out']['sampled_pass'] for r in rs) / len(rs)):>7} "
              f"{sum(r['train_s'] for r in rs) / len(rs):7.0f} "
              f"{(f'{sum(ratios) / len(ratios):.2f}' if ratios else '-'):>6}  "
              + " ".join(f"{met[k]}/{judged[k]}" if judged[k] else "-" for k in "abcd"))


def report(out: Path) -> dict[int, dict[str, dict]]:
    """The tables of OUT (its seed-S/ARM/arm.json files): per seed, then the summary."""
    runs: dict[int, dict[str, dict]] = {}
    for seed_dir in sorted(out.glob("seed-*"), key=lambda d: int(d.name[5:])):
        found = {a: json.loads((seed_dir / a / "arm.json").read_text()) for a in ARMS
                 if (seed_dir / a / "arm.json").exists()}
        if found:
            runs[int(seed_dir.name[5:])] = found
    for seed, results in runs.items():
        add_time_to_sync(results)
        for arm, g in print_seed(seed, results).items():
            results[arm]["goals"] = g
        print_probe(seed, results)
    if runs:
        summary(runs)
    return runs


def rescore(out: Path, bench: argparse.Namespace) -> None:
    """Each harnessrl arm's final checkpoint under OUT (seed-S/ARM/checkpoints/step-N, N its
    last curve step) scored again by `learning.evaluate`; its arm.json gets the new `held_out`
    and final curve point, the earlier scores as `held_out_before`."""
    for arm_dir in sorted(out.glob("seed-*/*/checkpoints")):
        if not (arm_dir.parent / "arm.json").exists() and arm_dir.parent.name in ARMS:
            _arm_from_run(arm_dir.parent, bench)  # stopped after training: its record from its metrics
    for path in sorted(out.glob("seed-*/*/arm.json")):
        r = json.loads(path.read_text())
        final = path.parent / "checkpoints" / f"step-{int(r['curve'][-1][0])}"
        if ARMS.get(r["arm"]) is None or not (final / "config.json").exists():
            continue
        bench.seed = r["seed"]
        scores = asyncio.run(learning.evaluate(final, bench))
        r.setdefault("held_out_before", r["held_out"])
        r["held_out"], r["curve"][-1][2] = scores, scores["sampled_pass"]
        path.write_text(json.dumps(r, indent=1))
        print(f"{path.parent}: greedy {scores['pass']:.1%}, sampled {scores['sampled_pass']:.1%}", flush=True)


def _arm_from_run(out: Path, bench: argparse.Namespace) -> None:
    """OUT/arm.json of a harnessrl arm whose process was stopped after its training (its
    `metrics.jsonl` and final checkpoint written, no scores): the training time, clip and probe
    from its metrics, the final checkpoint's curve point scored by `rescore` (the intermediate
    checkpoints are not scored; `wall_s` is the training time)."""
    from harnessrl.jsonl import read_jsonl

    history = read_jsonl(out / "metrics.jsonl").rows
    times = cumulative_times(history)
    spec = ARMS[out.name]
    assert spec is not None
    label, _ = loss_label(spec.sets, bench.set)
    r = {"arm": out.name, "seed": int(out.parent.name[5:]), "held_out": {"pass": math.nan, "sampled_pass": math.nan},
         "train_s": times[max(times)], "wall_s": times[max(times)], "curve": [[max(times), times[max(times)], math.nan]],
         "loss": label, "clip_max": max_clip(history), "history": learning.jsonable(history),
         "probe": probe(history, out / "rollouts.jsonl", bench.prompts_per_step), "peak_rss_gb": math.nan,
         "load": [math.nan, math.nan]}
    (out / "arm.json").write_text(json.dumps(r, indent=1))


def main() -> None:
    own, bench = parse_args()
    import torch

    torch.set_num_threads(2)
    if own.report:
        report(own.report)
        return
    if own.rescore:
        rescore(own.rescore, bench)
        report(own.rescore)
        return
    from harnessrl.engine.model_store import resolve_model

    model_dir = resolve_model(bench.model)
    if bench.warm_start:
        import tool_warmstart as tw

        model_dir = tw.warm_start(model_dir, tw.default_config(**({"answer_frac": bench.warm_start_answer_frac}
                                   if bench.warm_start_answer_frac is not None else {})), threads=2)
        bench.model = str(model_dir)
    if own.arm_only:
        bench.seed = own.seed
        run_arm(own.arm_only, bench, model_dir, own.out, own.eval_every)
        return
    out = own.out or Path(tempfile.mkdtemp(prefix="harnessrl-async-learning-"))
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} cores); "
          f"out {out}", flush=True)
    for seed in own.seeds:
        for arm in own.arms:
            t0 = time.monotonic()
            try:
                learning.arm_in_child(arm, seed, out / f"seed-{seed}" / arm, Path(__file__).resolve())
            except (RuntimeError, learning.TrlArmFailed) as exc:
                print(f"seed {seed}, {arm}: no result ({exc})", flush=True)
            print(f"seed {seed}, {arm}: done in {time.monotonic() - t0:.0f} s (evaluations included)", flush=True)
    runs = report(out)
    (out / "async_learning.json").write_text(json.dumps({"argv": sys.argv[1:], "runs": runs}, indent=1))
    print(f"results: {out / 'async_learning.json'}")


if __name__ == "__main__":
    main()
