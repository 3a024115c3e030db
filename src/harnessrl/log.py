"""Logging set-up and the `MetricsSink` seam: where per-step numbers go.

Responsibility: send one flat dict of numbers per step to every chosen sink. JSONL is always on
(`metrics.jsonl` in the run directory, one line per step, flushed at once); TensorBoard and
trackio are optional and imported only when chosen.

What it does not do: compute metrics (each number comes from one tested function elsewhere).
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any, Protocol

from harnessrl.errors import ConfigError


class MetricsSink(Protocol):
    def log(self, step: int, metrics: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """Appends `{"step": k, **metrics}` per line; non-finite floats are written as null."""

    def __init__(self, path: Path) -> None:
        from harnessrl.jsonl import repair_torn_tail

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


class TensorBoardSink:
    def __init__(self, log_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ConfigError("report_to includes 'tensorboard' but tensorboard is not installed "
                              "(pip install 'harnessrl[tensorboard]')") from exc
        self._writer = SummaryWriter(str(log_dir))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class TrackioSink:
    def __init__(self, project: str, run_name: str, config: dict[str, Any]) -> None:
        try:
            import trackio  # type: ignore[import-not-found]
        except ImportError as exc:
            raise ConfigError("report_to includes 'trackio' but trackio is not installed "
                              "(pip install 'harnessrl[trackio]')") from exc
        self._trackio = trackio
        trackio.init(project=project, name=run_name, config=config)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        numeric = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        self._trackio.log(numeric, step=step)

    def close(self) -> None:
        self._trackio.finish()


def make_sinks(report_to: list[str], run_dir: Path, config: dict[str, Any]) -> list[MetricsSink]:
    """JSONL always, plus each of `report_to` (`tensorboard`, `trackio`).

    Raises:
        ConfigError: an unknown sink name, or a chosen sink whose package is not installed.
    """
    unknown = [name for name in report_to if name not in ("jsonl", "tensorboard", "trackio")]
    if unknown:
        raise ConfigError(f"log.report_to: unknown sink {unknown[0]!r} (jsonl, tensorboard, trackio)")
    sinks: list[MetricsSink] = [JsonlSink(run_dir / "metrics.jsonl")]
    for name in report_to:
        match name:
            case "jsonl":
                pass
            case "tensorboard":
                sinks.append(TensorBoardSink(run_dir / "tensorboard"))
            case "trackio":
                sinks.append(TrackioSink("harnessrl", run_dir.name, config))
    return sinks


def setup_logging(level: str = "INFO", path: Path | None = None, console: Any = None) -> None:
    """Send log records (progress, per-rollout lines, step lines, events) to `path` and stderr.

    `path` (the run's `run.log`) gets every record as a plain timestamped line. stderr gets them
    through rich on a terminal, on `console` when given (a `rich.console.Console` writing to
    stderr, so that records print above its live progress display), and as plain timestamped
    lines otherwise (pipes, CI, `nohup`), so a run that is not watched still says what it does.
    """
    import sys

    handlers: list[logging.Handler] = []
    plain = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    if sys.stderr.isatty():
        from rich.console import Console
        from rich.logging import RichHandler

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
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover - transformers is a dependency
        return
    hf_logging.disable_progress_bar()


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
