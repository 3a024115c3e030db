"""A new user's first hour: the README's and the docs' commands as written, and the mistakes a
first hour makes with them.

Good forms: each documented command runs through the real command line in process
(`typer.testing.CliRunner`) with every check it makes (config, options, `--steps` /
`--resume` / `--out`, the task source and its verifier, the model's name, isolation); only the
call that would then train, roll out or serve is replaced by a recorder, which must receive the
documented settings, and nothing may be written before it.

Bad forms: the installed `harnessrl` as a subprocess, as a user runs it: a non-zero exit, stderr
one line naming the option, key or value, no traceback, and the earlier run in `--out` (or any
other directory named) unchanged, file by file with its mtime, with no `DIR.<time>` beside it.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from harnessrl.cli import app
from harnessrl.config import dump_config, load_config
from harnessrl.sandbox.bwrap import bwrap_path

REPO = Path(__file__).resolve().parents[1]
CLI = str(Path(sys.executable).with_name("harnessrl"))
ISOLATION = [] if bwrap_path() is not None else ["--set", 'sandbox.isolation="best_effort"']
"""Training refuses to start without bubblewrap by default; where it is missing the good forms
say so explicitly (that refusal has its own test in `tests/test_sandbox_isolation.py`)."""


# --- good forms: the documented commands, up to the call that would run -------------------------


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[tuple[object, ...], dict[str, object]]] = []

    def __call__(self, *args: object, **kwargs: object) -> int:
        self.calls.append((args, kwargs))
        return 0


@pytest.fixture
def stubs(monkeypatch: pytest.MonkeyPatch) -> dict[str, Recorder]:
    import harnessrl.run_rollouts
    import harnessrl.serve
    import harnessrl.train.run

    found = {"train": Recorder(), "rollout": Recorder(), "serve": Recorder()}
    monkeypatch.setattr(harnessrl.train.run, "run_training", found["train"])
    monkeypatch.setattr(harnessrl.run_rollouts, "run_evaluation", found["rollout"])
    monkeypatch.setattr(harnessrl.serve, "serve", found["serve"])
    monkeypatch.chdir(REPO)  # the docs' paths (examples/...) are relative to the checkout
    return found


def _earlier_run(run_dir: Path) -> Path:
    """What a finished run leaves: config, logs, a checkpoint with a model directory."""
    (run_dir / "checkpoints" / "step-8").mkdir(parents=True)
    (run_dir / "config.toml").write_text(dump_config(load_config(None)), encoding="utf-8")
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n', encoding="utf-8")
    (run_dir / "rollouts.jsonl").write_text("", encoding="utf-8")
    (run_dir / "checkpoints" / "step-8" / "config.json").write_text("{}", encoding="utf-8")
    (run_dir / "checkpoints" / "step-8" / "state.json").write_text('{"step": 8}', encoding="utf-8")
    return run_dir


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under `root`'s parent (so a sibling `DIR.<time>` shows), with mtime and size."""
    return {str(p.relative_to(root.parent)): (p.stat().st_mtime_ns, p.stat().st_size)
            for p in sorted(root.parent.rglob("*"))}


def _invoke(argv: list[str]) -> None:
    result = CliRunner().invoke(app, argv, catch_exceptions=False)
    assert result.exit_code == 0, result.output


def test_the_readmes_training_command(stubs: dict[str, Recorder], tmp_path: Path) -> None:
    out = tmp_path / "runs" / "default"
    written = ("train --steps 8 --out runs/default --set train.groups_per_step=2 --set train.learning_rate=2e-5 "
               "--set train.eval_every=8 --set train.eval_size=16 --set train.eval_samples=1")
    _invoke([str(out) if a == "runs/default" else a for a in shlex.split(written)] + ISOLATION)
    (cfg, run_dir), kwargs = stubs["train"].calls[0]
    assert run_dir == out and set(kwargs) == {"resume", "prepared"} and kwargs["resume"] is False
    assert kwargs["prepared"].tasks is not None  # what the checks built, handed on (built once)
    assert (cfg.train.steps, cfg.train.groups_per_step, cfg.train.learning_rate, cfg.train.eval_every) == (8, 2, 2e-5, 8)
    assert not (tmp_path / "runs").exists(), "nothing is made before the run starts"


def test_the_readmes_resume_and_serve_commands(stubs: dict[str, Recorder], tmp_path: Path) -> None:
    run = _earlier_run(tmp_path / "runs" / "default")
    before = _snapshot(run)
    _invoke(["train", "--resume", str(run), "--steps", "12", *ISOLATION])
    (cfg, run_dir), kwargs = stubs["train"].calls[0]
    assert run_dir == run and kwargs["resume"] is True and cfg.train.steps == 12
    _invoke(["serve", "--config", str(run / "config.toml"), "--model", str(run / "checkpoints" / "step-8")])
    ((served,), _) = stubs["serve"].calls[0]
    assert served.engine.model == str(run / "checkpoints" / "step-8")
    assert _snapshot(run) == before


@pytest.mark.parametrize("written", [
    "rollout --config examples/byo/letters.toml --limit 2",  # configuration.md, commands.md
    "rollout --set tasks.kind=humaneval --set rollout.group_size=2 --limit 4",  # harnesses.md
    "rollout --config examples/opencode_stdio.toml --set rollout.group_size=2 --limit 1",  # harnesses.md
    "rollout --set engine.model=tiny-random --set harness.kind=mini-swe-agent --set rollout.group_size=2 --limit 1",
])
def test_the_docs_rollout_commands(stubs: dict[str, Recorder], tmp_path: Path, written: str) -> None:
    out = tmp_path / "eval"
    _invoke([*shlex.split(written), "--out", str(out)])
    (cfg, out_dir), kwargs = stubs["rollout"].calls[0]
    assert out_dir == out and kwargs["limit"] == int(written.rsplit(" ", 1)[1])
    assert not out.exists()


def test_the_multi_turn_job_as_make_runs_it(stubs: dict[str, Recorder], tmp_path: Path) -> None:
    # make train-agent: harnessrl train --steps 8 --out runs/agent --config examples/train_agent.toml + EVAL
    _invoke(["train", "--steps", "8", "--out", str(tmp_path / "agent"), "--config", "examples/train_agent.toml",
             "--set", "train.eval_every=8", "--set", "train.eval_size=16", "--set", "train.eval_samples=1", *ISOLATION])
    (cfg, _), _ = stubs["train"].calls[0]
    assert cfg.harness.kind == load_config(REPO / "examples" / "train_agent.toml").harness.kind


# --- bad forms: one line, nothing touched ----------------------------------------------------


@pytest.fixture
def place(tmp_path: Path) -> Path:
    _earlier_run(tmp_path / "runs" / "default")
    (tmp_path / "a-file").write_text("not a directory", encoding="utf-8")
    (tmp_path / "bad.toml").write_text("bogus = 1\n", encoding="utf-8")
    return tmp_path


RUN = "runs/default"
BAD: list[tuple[str, str]] = [
    # (argv as a user types it in the directory holding runs/default, what stderr must name)
    ("train --config bad.toml --out runs/default", r"unknown key 'bogus' in bad\.toml"),
    ("train --config missing.toml --out runs/default", r"config file not found: missing\.toml"),
    ("train --steps 0 --out runs/default", r"--steps 0: must be >= 1"),
    ("train --steps -3 --out runs/default", r"--steps -3: must be >= 1"),
    ("train --out runs/default --set tasks.kind=stdio --set tasks.path=missing.jsonl", r"missing\.jsonl"),
    ("train --out runs/default --set tasks.kind=python --set tasks.source=json:loads", r"tasks\.source = 'json:loads'.*raised TypeError"),
    ("train --out runs/default --set engine.model=/no/such/model", r"engine\.model = '/no/such/model'"),
    ("train --out runs/default --set sampling.top_p=0.5", r"sampling\.top_p = 0\.5"),
    ("train --out runs/default --set train.lr=1", r"unknown key 'train\.lr'"),
    ("train --out runs/default --set tasks.kind=stdio --set tasks.path={examples}/stdio_tasks.jsonl "
     "--set train.eval_every=1 --set train.eval_size=500", r"train\.eval_size = 500 leaves no training task"),
    ("train --resume runs/default --out elsewhere", r"--out elsewhere with --resume runs/default"),
    ("train --resume runs/default --config bad.toml", r"--config bad\.toml with --resume"),
    ("train --resume runs/missing", r"--resume runs/missing: not a run directory"),
    ("train --out a-file", r"--out a-file: not a directory"),
    ("train --out a-file/run", r"--out a-file/run: not a directory \(a-file is not a directory\)"),
    ("rollout --out a-file", r"--out a-file: not a directory"),
    ("rollout --limit 0 --out runs/default", r"--limit 0: must be >= 1"),
    ("rollout --out runs/default --set tasks.kind=stdio --set tasks.path=missing.jsonl", r"missing\.jsonl"),
    ("rollout --compare runs/missing runs/default", r"runs/missing is not an evaluation directory"),
    ("view runs/default --out a-file", r"--out a-file: not a directory"),
    ("view runs/missing", r"runs/missing is not a run directory"),
    ("export runs/default --format bogus --out report", r"--format 'bogus' is unknown"),
    ("export runs/default --out a-file", r"--out a-file: not a directory"),
    ("serve --model /no/such/model", r"engine\.model = '/no/such/model'"),
    ("doctor --model /no/such/model", r"model '/no/such/model' is neither"),
    ("session open --url http://127.0.0.1:{closed} --token t", r"--url http://127\.0\.0\.1:\d+: no proxy admin API reached"),
    ("session open --url http://127.0.0.1:{closed}", r"--token: the admin token is required"),
    ("session open --url http://127.0.0.1:{refusing} --token wrong", r"--token: the proxy at --url \S+ refused the admin token \(401\)"),
    ("harness options bogus", r"harness\.kind='bogus' is unknown"),
    ("engine install bogus", r"unknown engine 'bogus'"),
    # command-line mistakes the parser finds: one line naming the command, the option, the value
    ("train --stepz 3 --out runs/default", r"^harnessrl: NoSuchOption: harnessrl train: No such option: --stepz"),
    ("train --steps abc --out runs/default", r"^harnessrl: BadParameter: harnessrl train: --steps 'abc': .*integer"),
    ("rollout --limit=many", r"harnessrl rollout: --limit 'many': .*integer"),
    ("serve --port x", r"harnessrl serve: --port 'x'"),
    ("view", r"harnessrl view: Missing argument 'run_dir'"),
    ("session open --bogus", r"harnessrl session open: No such option: --bogus"),
    ("bogus", r"harnessrl: No such command 'bogus'"),
]


@pytest.fixture(scope="module")
def ports() -> Iterator[dict[str, object]]:
    """A closed loopback port, one whose server refuses every admin token (401), and where the
    examples are."""

    class Refuse(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
            body = json.dumps({"error": {"message": "invalid admin token"}}).encode()
            self.send_response(401)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    yield {"closed": closed, "refusing": server.server_address[1], "examples": str(REPO / "examples")}
    server.shutdown()


@pytest.mark.parametrize(("written", "names"), BAD, ids=[w for w, _ in BAD])
def test_a_mistake_is_one_line_and_touches_nothing(place: Path, ports: dict[str, object], written: str,
                                                   names: str) -> None:
    before = _snapshot(place / RUN)
    env = {k: v for k, v in os.environ.items() if k != "HARNESSRL_ADMIN_TOKEN"}
    res = subprocess.run([CLI, *shlex.split(written.format(**ports))], cwd=place, capture_output=True, text=True,
                         timeout=120, env={**env, "HF_HUB_OFFLINE": "1", "NO_COLOR": "1", "COLUMNS": "300"})
    assert res.returncode in (1, 2), (res.returncode, res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert re.search(names, lines[0]), lines[0]
    assert _snapshot(place / RUN) == before, "the earlier run and its siblings are as they were"


def test_every_command_of_the_commands_page_is_in_this_suite() -> None:
    """docs/commands.md's table lists the commands; each has a mistake above (or a good form)."""
    page = (REPO / "docs" / "commands.md").read_text(encoding="utf-8")
    documented = {" ".join(m.split()[:2]) if m.split()[0] in ("session", "harness", "engine") else m.split()[0]
                  for m in re.findall(r"^\| `harnessrl ([a-z-]+(?: [a-z-]+)?)", page, flags=re.M)}
    covered = {" ".join(w.split()[:2]) if w.split()[0] in ("session", "harness", "engine") else w.split()[0]
               for w, _ in BAD}
    assert documented and documented - covered <= {"harness install", "engine compare"}, documented - covered
