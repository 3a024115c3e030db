"""Logging set-up and the `MetricsSink` seam: where per-step numbers go.

Responsibility: send one flat dict of numbers per step to every chosen sink (`log.sinks`).
JSONL is always on (`metrics.jsonl` in the run directory, one line per step, flushed at once).
TensorBoard (`RUN/tensorboard/`, `torch.utils.tensorboard`), trackio (its local store:
`$TRACKIO_DIR`, default `$HF_HOME/trackio`, one SQLite file per `log.project`, run named after
the run directory; no server) and W&B (`RUN/wandb/`, offline unless `WANDB_MODE` is set) are
optional, imported only when chosen, each from its extra (`harnessrl[tensorboard]`,
`[trackio]`, `[wandb]`); `check_sinks` refuses a missing package before anything starts. Each of
these three gets the run's config at start, the step metrics (numbers only; the held-out
evaluation is the step's `eval/*` keys, step 0 before the first update) and, per step, a table
of up to `log.table_rollouts` of that step's rollouts (step, task, status, reward, turns, final
answer), sampled evenly from what the run appended to `RUN/rollouts.jsonl` since the previous
step (`RolloutSample`: the run writes a step's rollouts before it logs the step). TensorBoard
has no table: it gets the config and each table as text (Markdown). A failing optional sink is
a warning, never the end of the run (`Guarded`).

What it does not do: compute metrics (each number comes from one tested function elsewhere).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

from rich.console import Console
from rich.logging import RichHandler

from harnessrl.errors import ConfigError
from harnessrl.jsonl import repair_torn_tail

SINKS = ("jsonl", "tensorboard", "trackio", "wandb")
"""The sink names `log.sinks` accepts."""

_PACKAGE = {"tensorboard": "tensorboard", "trackio": "trackio", "wandb": "wandb"}
"""Sink -> the module it imports (its extra has the same name)."""

TABLE_COLUMNS = ("step", "task", "status", "reward", "turns", "final_answer")
"""Columns of the rollout table (`RolloutSample.rows`)."""

ANSWER_CHARS = 500
"""A final answer longer than this is cut in the table (with "…")."""


class MetricsSink(Protocol):
    def log(self, step: int, metrics: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def check_sinks(names: Sequence[str]) -> None:
    """Each optional sink of `names` has its package installed (found, not imported).

    Raises:
        ConfigError: an unknown sink name, or a chosen sink whose package is missing, naming
            the extra that installs it.
    """
    for name in names:
        if name not in SINKS:
            raise ConfigError(f"log.sinks: unknown sink {name!r} ({', '.join(SINKS)})")
        module = _PACKAGE.get(name)
        if module is not None and importlib.util.find_spec(module) is None:
            raise ConfigError(f"log.sinks includes {name!r} but the package {module!r} is not installed "
                              f"(pip install 'harnessrl[{name}]')")


def make_sinks(sinks: Sequence[str], run_dir: Path, config: dict[str, Any], *, project: str = "harnessrl",
               table_rollouts: int = 8) -> list[MetricsSink]:
    """JSONL always, plus each of `sinks` (`tensorboard`, `trackio`, `wandb`; see the module
    docstring), the tables sampled from `run_dir/rollouts.jsonl`.

    Args:
        sinks: `log.sinks`; "jsonl" is implied.
        run_dir: the run directory (`metrics.jsonl`, `tensorboard/`, `wandb/` go there).
        config: the resolved run config (`RunConfig.model_dump(mode="json")`).
        project: trackio's project and W&B's (`log.project`).
        table_rollouts: rows of each step's rollout table (`log.table_rollouts`); 0: no table.

    Raises:
        ConfigError: an unknown sink name, or a chosen sink whose package is not installed.
    """
    check_sinks(sinks)
    out: list[MetricsSink] = [JsonlSink(run_dir / "metrics.jsonl")]
    sample = RolloutSample(run_dir / "rollouts.jsonl", table_rollouts)
    for name in dict.fromkeys(sinks):
        match name:
            case "tensorboard":
                out.append(Guarded(name, TensorBoardSink(run_dir / "tensorboard", config, sample)))
            case "trackio":
                out.append(Guarded(name, TrackioSink(project, run_dir.name, config, sample)))
            case "wandb":
                out.append(Guarded(name, WandbSink(run_dir, project, run_dir.name, config, sample)))
    return out


class Guarded:
    """An optional sink whose failure never stops the run: the first exception of `log` is
    logged as a warning naming the sink, which then receives no more steps (`metrics.jsonl`
    keeps every one); `close` is still called once (its exception, too, only a warning)."""

    def __init__(self, name: str, sink: MetricsSink) -> None:
        self.name, self.sink, self.failed = name, sink, False

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.failed:
            self._call(self.sink.log, step, metrics)

    def close(self) -> None:
        self._call(self.sink.close)

    def _call(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - a metrics sink is not worth a training run
            if not self.failed:
                logging.getLogger(__name__).warning("log.sinks: %s failed (%s: %s); it receives nothing more, "
                                                    "metrics.jsonl has every step", self.name, type(exc).__name__, exc)
            self.failed = True


class JsonlSink:
    """Appends `{"step": k, **metrics}` per line; non-finite floats are written as null."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        repair_torn_tail(path)  # a line torn by a killed writer never fuses with the next one
        self._fh = path.open("a", encoding="utf-8")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        self._fh.write(json.dumps(row) + "\n")
        self._fh.flush()

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()


class RolloutSample:
    """Up to `per_step` rollouts of each step, as table rows (`TABLE_COLUMNS`).

    Reads the complete lines appended to `path` (`RUN/rollouts.jsonl`) since the last step read
    (from its size at creation, so a resumed run starts after the rollouts already there) and
    keeps `per_step` of them evenly spaced (every ceil(n / per_step)-th line, the first
    included). Lines that do not parse are skipped. One instance serves every sink: the rows
    are read once per step.
    """

    def __init__(self, path: Path, per_step: int) -> None:
        self.path, self.per_step = path, per_step
        self._offset = path.stat().st_size if path.is_file() else 0
        self._step: int | None = None
        self._rows: list[list[Any]] = []

    def rows(self, step: int) -> list[list[Any]]:
        """The table rows of `step` (empty when no rollout was appended since the last step)."""
        if step != self._step:
            self._step, self._rows = step, self._read(step)
        return self._rows

    def _read(self, step: int) -> list[list[Any]]:
        if self.per_step <= 0 or not self.path.is_file():
            return []
        with self.path.open("rb") as fh:
            fh.seek(self._offset)
            data = fh.read()
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next step
        self._offset += end
        lines = [line for line in data[:end].splitlines() if line.strip()]
        stride = max(1, math.ceil(len(lines) / self.per_step))
        rows = []
        for line in lines[::stride][: self.per_step]:
            try:
                d = json.loads(line)
                answer = d.get("final_answer") or ""
                if len(answer) > ANSWER_CHARS:
                    answer = answer[:ANSWER_CHARS] + "…"
                reward = d.get("reward")
                rows.append([step, str(d["task_id"]), str(d.get("status", "")),
                             float(reward) if isinstance(reward, (int, float)) else None,
                             len(d["trace"]["turns"]), answer])
            except (ValueError, KeyError, TypeError):
                continue
        return rows


def _numbers(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}


class TensorBoardSink:
    """Scalars per metric key; the config (JSON) at step 0 and each step's rollout table as
    text (`config`, `rollouts` in TensorBoard's Text tab)."""

    def __init__(self, log_dir: Path, config: dict[str, Any], sample: RolloutSample) -> None:
        from torch.utils.tensorboard import SummaryWriter  # lazy: torch, heavy; not needed at import

        self._writer = SummaryWriter(str(log_dir))
        self._sample = sample
        self._writer.add_text("config", "```\n" + json.dumps(config, indent=1) + "\n```", 0)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        for key, value in _numbers(metrics).items():
            self._writer.add_scalar(key, value, step)
        rows = self._sample.rows(step)
        if rows:
            self._writer.add_text("rollouts", markdown_table(rows), step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class TrackioSink:
    """One trackio run (`trackio.init(project, name, config)`, local store, no dashboard, no
    system metrics): the numbers per step and the rollout table as `rollouts` (a
    `trackio.Table`)."""

    def __init__(self, project: str, run_name: str, config: dict[str, Any], sample: RolloutSample) -> None:
        import trackio  # type: ignore[import-not-found]  # lazy: trackio, heavy; not needed at import

        self._trackio = trackio
        self._sample = sample
        trackio.init(project=project, name=run_name, config=config, embed=False,
                     auto_log_cpu=False, auto_log_gpu=False)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        payload: dict[str, Any] = dict(_numbers(metrics))
        rows = self._sample.rows(step)
        if rows:
            payload["rollouts"] = self._trackio.Table(columns=list(TABLE_COLUMNS), data=rows)
        self._trackio.log(payload, step=step)

    def close(self) -> None:
        self._trackio.finish()


class WandbSink:
    """One W&B run under `RUN/wandb/` (`mode="offline"` unless `WANDB_MODE` is set, then W&B's
    own setting; console capture off): the config, the numbers per step and the rollout table
    as `rollouts` (a `wandb.Table`). An offline run is uploaded later with `wandb sync`."""

    def __init__(self, run_dir: Path, project: str, run_name: str, config: dict[str, Any],
                 sample: RolloutSample) -> None:
        import wandb  # type: ignore[import-not-found]  # lazy: wandb, heavy; not needed at import

        self._wandb = wandb
        self._sample = sample
        run_dir.mkdir(parents=True, exist_ok=True)
        mode: Literal["offline"] | None = None if os.environ.get("WANDB_MODE") else "offline"
        self._run = wandb.init(project=project, name=run_name, dir=str(run_dir), config=config, mode=mode,
                               settings=wandb.Settings(console="off", silent=True))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        payload: dict[str, Any] = dict(_numbers(metrics))
        rows = self._sample.rows(step)
        if rows:
            payload["rollouts"] = self._wandb.Table(columns=list(TABLE_COLUMNS), data=rows)
        self._run.log(payload, step=step)

    def close(self) -> None:
        self._run.finish()


def markdown_table(rows: list[list[Any]]) -> str:
    """`rows` under `TABLE_COLUMNS` as a Markdown table (`|` escaped, newlines as spaces)."""

    def cell(v: Any) -> str:
        text = "" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))
        return text.replace("\\", "\\\\").replace("|", "\\|").replace("\r", " ").replace("\n", " ")

    lines = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def setup_logging(level: str = "INFO", path: Path | None = None, console: Any = None) -> None:
    """Send log records (progress, per-rollout lines, step lines, events) to `path` and stderr.

    `path` (the run's `run.log`) gets every record as a plain timestamped line. stderr gets them
    through rich on a terminal, on `console` when given (a `rich.console.Console` writing to
    stderr, so that records print above its live progress display), and as plain timestamped
    lines otherwise (pipes, CI, `nohup`), so a run that is not watched still says what it does.
    """
    handlers: list[logging.Handler] = []
    plain = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    if sys.stderr.isatty():
        handlers.append(RichHandler(console=console or Console(stderr=True), show_path=False,
                                    rich_tracebacks=False, markup=False))
    else:
        stream = logging.StreamHandler(sys.stderr)
        stream.setFormatter(plain)
        handlers.append(stream)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fh = logging.FileHandler(path)
        fh.setFormatter(plain)
        handlers.append(fh)
    logging.basicConfig(level=level, handlers=handlers, format="%(message)s", force=True)
    for noisy in ("httpx", "uvicorn.access", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # transformers' per-load progress bars ("Loading weights") clutter the run's console
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        from transformers.utils import logging as hf_logging  # lazy: transformers, heavy; not needed at import
    except ImportError:  # pragma: no cover - transformers is a dependency
        return
    hf_logging.disable_progress_bar()


def to_run_log(text: str, name: str = "harnessrl.console") -> None:
    """Write `text` (what the console printed outside logging: a closing table, its summary
    lines) to the run's log file (`setup_logging`'s `path`, `run.log`) as one INFO record, and
    to no other handler, so stderr does not show it twice. Nothing happens without a file."""
    record = logging.LogRecord(name, logging.INFO, __file__, 0, "%s", (text,), None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def close_logging() -> None:
    """Flush and close the handlers `setup_logging` installed (the run's `run.log` included)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        handler.flush()
        handler.close()
        root.removeHandler(handler)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
