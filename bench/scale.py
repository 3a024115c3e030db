"""Scaling out: rollouts per minute at 1, 2 and 3 Ray nodes, trainer tokens/s at 1 and 2 ranks.

Rollouts: one `ray.cluster_utils.Cluster` of 3 nodes on this machine (one CPU and a 100 MB
object store each, no dashboard); node k offers the custom resources `scale_k`..`scale_3`, so
`rollout.ray.node_resource = "scale_N"` runs a measurement on the first N nodes. Each harness
is measured once with `rollout.executor = "local"` (the single-process run every ratio is
against) and at 1, 2, 3 nodes, each time `--groups` groups of `--group-size` rollouts of the
tiny model (`--model`), all dispatched at once, at most `--per-node` sandboxes per node (and
as many in flight overall as 3 nodes allow, also for the local run):
  * `white_box`: one sampled reply (no tools), sandbox and verifier on the node;
  * `command` (a CLI agent): a Python program in a bubblewrap sandbox on the node that makes one
    chat call through its node's relay and then works `--agent-work-s` seconds in its sandbox
    (a sleep: on 2 shared cores CPU-bound agent work could not spread).
Rollouts per minute = rollouts / (first dispatch to last group back), the runtime's start-up
excluded.

Trainer: `bench/scale_trainer.py --ranks 1` and `--ranks 2` (gloo on loopback), its JSON line
`{"ranks": N, "tokens_per_s": ...}`; skipped with a note when the script is missing.

Printed: one JSON line per measurement, then a table of ratios against the single-process run
(and, for the Ray runs, against 1 node).

    .venv/bin/python bench/scale.py            # about 4 minutes on 2 shared cores
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from harnessrl.recipes.smoke_agent import one_call_agent  # noqa: E402

HERE = Path(__file__).resolve().parent
NODES = (1, 2, 3)
AGENT = one_call_agent(max_tokens=8, timeout_s=120)


def harness_overrides(kind: str, work_s: float) -> list[str]:
    if kind == "white_box":
        return ['harness.kind="white_box"', "harness.options={tools = [], max_turns = 1}"]
    argv = json.dumps(["python3", "{state_dir}/agent.py", "{base_url}", "{api_key}", "{model}", str(work_s)])
    return ['harness.kind="command"',
            f'harness.options={{argv = {argv}, files = {{"agent.py" = {json.dumps(AGENT)}}}, '
            'final_answer_file = "answer.txt"}']


async def measure(overrides: list[str], n_groups: int) -> dict:
    """Rollouts of `n_groups` groups through the runtime the overrides describe."""
    from harnessrl.config import load_config
    from harnessrl.rollout.orchestrator import Orchestrator
    from harnessrl.rollout.runner import RolloutLimits
    from harnessrl.runtime import start_runtime

    cfg = load_config(None, overrides)
    async with start_runtime(cfg) as rt:
        orch = Orchestrator(rt.tasks, rt.harness, rt.backend, rt.proxy, rt.verifier_for,
                            group_size=cfg.rollout.group_size,
                            max_concurrent_rollouts=cfg.concurrent_rollouts,
                            limits=RolloutLimits(cfg.rollout.agent_timeout_s, cfg.rollout.verify_timeout_s))
        t0 = time.monotonic()
        orch.allow(n_groups)
        orch.start()
        try:
            groups = [await orch.get_group() for _ in range(n_groups)]
        finally:
            await orch.close()
        wall = time.monotonic() - t0
    rollouts = [r for g in groups for r in g.rollouts]
    statuses: dict[str, int] = {}
    for r in rollouts:
        statuses[r.status] = statuses.get(r.status, 0) + 1
    nodes = {r.metadata.get("node_id") for r in rollouts} - {None}
    return {"rollouts": len(rollouts), "wall_s": round(wall, 2),
            "rollouts_per_min": round(60 * len(rollouts) / wall, 1), "statuses": statuses, "nodes_used": len(nodes)}


def trainer(ranks: int, steps: int) -> dict | None:
    script = HERE / "scale_trainer.py"
    if not script.exists():
        return None
    done = subprocess.run([sys.executable, str(script), "--ranks", str(ranks), "--steps", str(steps)],
                          capture_output=True, text=True, timeout=900, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"scale_trainer.py --ranks {ranks} failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(lines[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-random")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--group-size", type=int, default=3)
    p.add_argument("--per-node", type=int, default=2, help="rollout.ray.max_sandboxes_per_node")
    p.add_argument("--agent-work-s", type=float, default=3.0)
    p.add_argument("--harnesses", default="white_box,command")
    p.add_argument("--trainer-steps", type=int, default=3)
    p.add_argument("--no-trainer", action="store_true")
    args = p.parse_args()

    import ray
    from ray.cluster_utils import Cluster

    from harnessrl.sandbox.config import default_root_dir

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "object_store_memory": 100 << 20, "include_dashboard": False,
        "resources": {f"scale_{k}": 1 for k in NODES}})
    results: dict[str, dict] = {}
    try:
        for first in NODES[1:]:
            cluster.add_node(num_cpus=1, object_store_memory=100 << 20,
                             resources={f"scale_{k}": 1 for k in NODES if k >= first})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False, namespace="harnessrl")
        in_flight = args.per_node * NODES[-1]
        base = [f"engine.model={json.dumps(args.model)}", "sampling.max_tokens=8",
                f"rollout.group_size={args.group_size}", f"rollout.max_concurrent_rollouts={in_flight}",
                "rollout.agent_timeout_s=120", f'sandbox.root_dir="{default_root_dir() / "bench-scale"}"']
        for kind in args.harnesses.split(","):
            runs = {"local": [*base, *harness_overrides(kind, args.agent_work_s)]}
            for n in NODES:
                runs[f"ray_{n}"] = [*runs["local"], "rollout.executor=ray", f"rollout.ray.node_resource=scale_{n}",
                                    f"rollout.ray.max_sandboxes_per_node={args.per_node}"]
            for name, overrides in runs.items():
                res = asyncio.run(measure(overrides, args.groups))
                results[f"{kind}/{name}"] = res
                print(json.dumps({"harness": kind, "run": name, **res}), flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()

    trainer_rows: dict[int, dict] = {}
    note = ""
    if args.no_trainer:
        note = "trainer: skipped (--no-trainer)"
    else:
        for ranks in (1, 2):
            row = trainer(ranks, args.trainer_steps)
            if row is None:
                note = "trainer: bench/scale_trainer.py is not there; skipped"
                break
            trainer_rows[ranks] = row
            print(json.dumps({"trainer": True, **row}), flush=True)

    print()
    print(f"{'measurement':<34}{'value':>10}{'vs single process':>20}{'vs 1 node':>12}")
    for kind in args.harnesses.split(","):
        local = results[f"{kind}/local"]["rollouts_per_min"]
        one = results[f"{kind}/ray_1"]["rollouts_per_min"]
        for name in ("local", *(f"ray_{n}" for n in NODES)):
            res = results[f"{kind}/{name}"]
            vs_one = f"{res['rollouts_per_min'] / one:>11.2f}x" if name != "local" else ""
            print(f"{kind + ' rollouts/min ' + name:<34}{res['rollouts_per_min']:>10.1f}"
                  f"{res['rollouts_per_min'] / local:>19.2f}x{vs_one}")
    if trainer_rows:
        one = trainer_rows[1]["tokens_per_s"]
        for ranks, row in trainer_rows.items():
            print(f"{f'trainer tokens/s {ranks} rank':<34}{row['tokens_per_s']:>10.1f}{row['tokens_per_s'] / one:>19.2f}x")
    if note:
        print(note)


if __name__ == "__main__":
    main()
