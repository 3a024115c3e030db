"""How a run is put together: one shape for the run's sampling, mapped to the proxy by one
function; the proxy's bounds a `[proxy]` table of the run config, each one settable and
validated."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from harnessrl.config import load_config
from harnessrl.errors import ConfigError
from harnessrl.proxy.config import ProxyBounds, ProxyConfig
from harnessrl.runtime import proxy_config_for
from harnessrl.serve import proxy_config_for_serve

SRC = Path(__file__).resolve().parents[1] / "src" / "harnessrl"


def test_every_proxy_bound_is_a_run_config_key_and_reaches_the_proxy() -> None:
    """Each bound set in `[proxy]` arrives in the proxy of `train` / `rollout` and of `serve`."""
    bounds = ProxyBounds.model_fields
    assert len(bounds) == 20
    overrides = {name: (field.default + 1 if isinstance(field.default, int) else field.default * 2)
                 for name, field in bounds.items()}
    cfg = load_config(None, [f"proxy.{k}={v}" for k, v in overrides.items()] + ["sampling.temperature=0.7"])
    for proxy in (proxy_config_for(cfg, "m"), proxy_config_for_serve(cfg, host="127.0.0.1", port=0)):
        assert {k: getattr(proxy, k) for k in bounds} == overrides
        assert proxy.sampling is cfg.sampling and proxy.sampling.temperature == 0.7 and proxy.enforce_sampling
    assert set(ProxyConfig.model_fields) - set(bounds) == {"host", "port", "model_name", "sampling",
                                                          "enforce_sampling", "trace_path"}


def test_a_proxy_bound_out_of_range_is_refused_naming_its_key() -> None:
    with pytest.raises(ConfigError, match=r"proxy\.max_json_depth"):
        load_config(None, ["proxy.max_json_depth=500"])
    with pytest.raises(ConfigError, match=r"unknown key 'rollout\.max_model_calls'"):
        load_config(None, ["rollout.max_model_calls=3"])  # one home for it: proxy.max_model_calls
    with pytest.raises(ConfigError, match=r"sampling\.temperature must be above 0"):
        load_config(None, ["sampling.temperature=0"])


def test_one_sampling_shape_with_one_default() -> None:
    """The run config's `[sampling]` and the proxy's are the same model, with the same defaults."""
    cfg = load_config(None)
    assert type(cfg.sampling) is type(ProxyConfig().sampling)
    assert ProxyConfig().sampling.temperature == cfg.sampling.temperature == 0.4


def _calls(name: str, with_arguments: bool = False) -> list[str]:
    """The module of every call of `name` under src/harnessrl (`with_arguments`: those that pass
    any)."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                func = node.func
                called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
                if called == name and (node.args or node.keywords or not with_arguments):
                    found.append(str(path.relative_to(SRC)))
    return found


def test_one_function_maps_the_run_sampling_to_the_proxy() -> None:
    """`ProxyConfig` is given its values in one place (`proxy_config`); every command goes
    through it."""
    assert _calls("ProxyConfig", with_arguments=True) == ["proxy/config.py"]
    assert sorted(_calls("proxy_config")) == ["runtime.py", "serve.py"]
