"""The private overlays of shared trees (`sandbox/layers.py`): per command in a mount namespace
of its own (nothing reaches the host's), per podman sandbox in the host's (unmounted at close,
a killed run's by `remove_orphan_mounts`, a live run's never)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from harnessrl.sandbox import layers
from harnessrl.sandbox.podman import STATE_PREFIX, remove_orphan_mounts

pytestmark = pytest.mark.skipif(layers.layers_supported() is not None,
                                reason=f"no overlays here: {layers.layers_supported()}")


def _tree(tmp_path: Path) -> Path:
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "file").write_text("data\n")
    return tree


def test_a_command_gets_its_own_overlay_and_the_host_keeps_nothing(tmp_path: Path) -> None:
    tree, staging = _tree(tmp_path), tmp_path / "staging"
    staging.mkdir(mode=0o700)
    trees = layers.TreeLayers(staging, (tree,), devices=True)
    done = subprocess.run(["sh", "-c", f"cat {trees.source(0)}/sub/file; grep ' {trees.source(0)} ' /proc/self/mountinfo;"
                           f" ls {trees.devices_dir}; echo x > {trees.source(0)}/new"],
                          preexec_fn=trees.mount, capture_output=True, text=True, timeout=30)
    assert done.stdout.startswith("data\n"), done
    assert "lowerdir=tree0:empty" in done.stdout and str(tree) not in done.stdout, done.stdout
    assert "null" in done.stdout.split() and "Read-only file system" in done.stderr, done
    assert not (tree / "new").exists()
    assert os.listdir(staging) == []  # the tmpfs and its overlays went with the namespace
    assert [p for p in layers.mount_points() if p.startswith(str(tmp_path))] == []


def test_host_mounts_unmount_and_orphans_of_dead_runs_only(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    dead = subprocess.Popen(["true"])
    dead.wait()
    live_state = tmp_path / f"{STATE_PREFIX}{os.getpid()}-sb-abc"
    dead_state = tmp_path / f"{STATE_PREFIX}{dead.pid}-sb-def"
    try:
        for state in (live_state, dead_state):
            state.mkdir()
            [mounted] = layers.host_mounts(state / "trees", [tree])
            assert (mounted / "sub" / "file").read_text() == "data\n"
        assert remove_orphan_mounts(tmp_path) == 1
        assert not dead_state.exists()
        assert (live_state / "trees" / "m0" / "sub" / "file").exists()  # a live run's stays
    finally:
        assert layers.unmount_below(tmp_path) == []
    assert [p for p in layers.mount_points() if p.startswith(str(tmp_path))] == []
    assert (tree / "sub" / "file").read_text() == "data\n"


async def test_a_tree_that_cannot_be_overlaid_is_bound_as_it_is_and_named(tmp_path: Path) -> None:
    from harnessrl.sandbox.bwrap import bwrap_path
    from harnessrl.sandbox.local import LocalSandboxBackend, SandboxConfig

    if bwrap_path() is None:
        pytest.skip("bubblewrap is not installed")
    tool = tmp_path / "tool.sh"  # a file, not a directory: no overlay of it
    tool.write_text("echo tool\n")
    backend = LocalSandboxBackend(SandboxConfig(root_dir=tmp_path / "sandboxes", use_bwrap=True), ro_binds=(tool,))
    assert any(str(tool) in gap and "bound as they are" in gap for gap in backend.unisolated())
    sb = await backend.create("file-bind", {})
    try:
        r = await sb.exec(["sh", sb.tree_path(tool)], 30)
        assert r.stdout == "tool\n", r
    finally:
        await sb.close()
