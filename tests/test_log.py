"""Metrics sinks: JSONL always (non-finite numbers as null), TensorBoard when chosen, unknown names refused
(the other sinks, read back: `test_sinks.py`)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from harnessrl.errors import ConfigError
from harnessrl.log import make_sinks


def test_jsonl_sink_writes_one_line_per_step(tmp_path: Path) -> None:
    (sink,) = make_sinks(["jsonl"], tmp_path, {})
    sink.log(0, {"loss": 0.5, "staleness_mean": math.nan})
    sink.log(1, {"loss": 0.25})
    sink.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 0, "loss": 0.5, "staleness_mean": None}, {"step": 1, "loss": 0.25}]


def test_tensorboard_sink_writes_events(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    sinks = make_sinks(["tensorboard"], tmp_path, {})
    assert len(sinks) == 2
    for sink in sinks:
        sink.log(0, {"loss": 1.0, "note": "text is skipped"})
        sink.close()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_unknown_sink_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="mlflow"):
        make_sinks(["mlflow"], tmp_path, {})


def test_off_a_terminal_records_go_to_stderr_and_run_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import logging

    from harnessrl.log import close_logging, setup_logging

    setup_logging("INFO", tmp_path / "run.log")
    try:
        logging.getLogger("harnessrl.test").info("rollout 1/4 procedural/add ok reward 1.00")
        logging.getLogger("harnessrl.test").debug("not at INFO")
    finally:
        close_logging()
    err = capsys.readouterr().err
    assert "INFO harnessrl.test: rollout 1/4 procedural/add ok reward 1.00" in err
    text = (tmp_path / "run.log").read_text()
    assert "rollout 1/4 procedural/add ok reward 1.00" in text and "not at INFO" not in text
