"""`[sandbox] kind = "podman"` in a run config, and the backend chosen from it (no container
is started here; `test_sandbox_container.py` runs them)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from harnessrl.config import RunConfig
from harnessrl.errors import SandboxError
from harnessrl.sandbox.config import PodmanSandboxConfig, SandboxConfig
from harnessrl.sandbox.local import LocalSandboxBackend
from harnessrl.sandbox.podman import PodmanSandboxBackend
from harnessrl.sandbox.select import make_backend


def test_the_sandbox_table_selects_its_kind(tmp_path: Path) -> None:
    cfg = RunConfig.model_validate({"sandbox": {"kind": "podman", "image": "localhost/x:1", "memory_bytes": 1 << 30,
                                                "cpus": 0.5, "root_dir": str(tmp_path)}})
    assert isinstance(cfg.sandbox, PodmanSandboxConfig)
    assert (cfg.sandbox.image, cfg.sandbox.memory_bytes, cfg.sandbox.cpus) == ("localhost/x:1", 1 << 30, 0.5)
    assert isinstance(make_backend(cfg.sandbox), PodmanSandboxBackend)
    default = RunConfig.model_validate({})
    assert isinstance(default.sandbox, SandboxConfig) and isinstance(make_backend(default.sandbox), LocalSandboxBackend)


@pytest.mark.parametrize(("table", "field"), [
    ({"kind": "podman", "use_bwrap": True}, "use_bwrap"),  # a local key under podman
    ({"kind": "podman", "memory_bytes": 1024}, "memory_bytes"),
    ({"kind": "podman", "cpus": 0}, "cpus"),
    ({"kind": "podman", "max_processes": 2}, "max_processes"),
    ({"kind": "docker"}, "kind"),
])
def test_bad_podman_keys_are_refused_naming_them(table: dict, field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        RunConfig.model_validate({"sandbox": table})


def test_the_backend_refuses_half_a_proxy_route(tmp_path: Path) -> None:
    with pytest.raises(SandboxError, match="give both or neither"):
        PodmanSandboxBackend(PodmanSandboxConfig(root_dir=tmp_path), proxy_port=1234)


def test_a_missing_image_stops_the_run_naming_it(tmp_path: Path) -> None:
    cfg = PodmanSandboxConfig(root_dir=tmp_path, image="localhost/harnessrl-no-such-image:0")
    with pytest.raises(SandboxError, match="cannot run here: .*(no-such-image|root|podman)"):
        PodmanSandboxBackend(cfg).check_isolation("best_effort")


def test_a_podman_sandbox_table_round_trips_through_the_saved_config(tmp_path: Path) -> None:
    from harnessrl.config import dump_config, load_config

    cfg = load_config(None, ['sandbox.kind="podman"', "sandbox.cpus=0.5", "sandbox.max_processes=64"])
    saved = tmp_path / "config.toml"
    saved.write_text(dump_config(cfg))
    again = load_config(saved)
    assert again.sandbox == cfg.sandbox and isinstance(again.sandbox, PodmanSandboxConfig)
    assert (again.sandbox.cpus, again.sandbox.max_processes) == (0.5, 64)
