"""The tested engine ranges: inside them the plugins say nothing; outside, one line naming the
version, the range and what may break, and the plugin still registers (no engine started)."""

from __future__ import annotations

import importlib.util
import logging

import pytest

from hpkv.integrations import versions
from hpkv.integrations.sglang import plugin as sglang_plugin
from hpkv.integrations.vllm import plugin as vllm_plugin


@pytest.fixture(autouse=True)
def not_yet_said(monkeypatch):
    monkeypatch.delenv("_HPKV_VERSION_SAID", raising=False)


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("hpkv") and r.levelno >= logging.WARNING]


@pytest.mark.parametrize(
    ("version", "inside"),
    [
        ("0.32.0", True),
        ("0.32.0+cpu", True),
        ("0.32.5", True),
        ("0.31.1", True),
        ("0.33.0", True),
        ("0.34.0", True),
        ("0.34.2+cu130", True),
        ("0.30.2", False),
        ("0.35.0rc1", False),
        ("1.0", False),
        ("", False),
    ],
)
def test_the_vllm_range_by_version_string(version, inside):
    assert (versions.outside_tested("vLLM", version) is None) is inside


needs_sglang = pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs SGLang installed")


def test_the_running_vllm_is_inside_the_range():
    assert versions.outside_tested("vLLM", vllm_plugin.vllm_version()) is None


@needs_sglang
def test_the_installed_sglang_is_inside_the_range():
    assert versions.outside_tested("SGLang", sglang_plugin.sglang_version()) is None


def test_vllm_inside_the_range_says_nothing(caplog):
    with caplog.at_level(logging.DEBUG, logger="hpkv"):
        vllm_plugin.register()
    assert _lines(caplog) == []


def test_vllm_outside_the_range_says_one_line_and_still_registers(monkeypatch, caplog):
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    monkeypatch.setattr(vllm, "__version__", "0.29.1")
    with caplog.at_level(logging.DEBUG, logger="hpkv"):
        vllm_plugin.register()
        vllm_plugin.register()  # vLLM loads plugins in every process: still one line
    [line] = _lines(caplog)
    assert "vLLM 0.29.1" in line and ">=0.31.0, <0.35.0" in line and "may fail to start" in line
    assert vllm_plugin.CONNECTOR_NAME in KVConnectorFactory._registry


@needs_sglang
def test_sglang_inside_the_range_says_nothing(caplog):
    with caplog.at_level(logging.DEBUG, logger="hpkv"):
        sglang_plugin.register()
    assert _lines(caplog) == []


@needs_sglang
def test_sglang_outside_the_range_says_one_line(monkeypatch, tmp_path, caplog):
    """Another SGLang's package metadata first on the path, as an other install would be."""
    dist = tmp_path / "sglang-0.6.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.6.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with caplog.at_level(logging.DEBUG, logger="hpkv"):
        sglang_plugin.register()
    [line] = _lines(caplog)
    assert "SGLang 0.6.0" in line and ">=0.5.23, <0.5.24" in line
