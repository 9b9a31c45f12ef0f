"""The vLLM plugin, in vLLM's own registries (no engine started)."""

from __future__ import annotations

from vllm import envs
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

from hpkv.integrations.vllm.plugin import CONNECTOR_NAME, register


def test_the_connector_and_hpkvs_variables_are_known_to_vllm():
    register()
    register()  # vLLM calls it in every process, maybe more than once
    assert CONNECTOR_NAME in KVConnectorFactory._registry
    assert {"VLLM_ENABLE_HPKV", "VLLM_HPKV_TOKEN_THRESHOLD"} <= set(envs.environment_variables)


def test_tuning_hpkv_leaves_vllms_compile_cache_key_alone(monkeypatch):
    """vLLM hashes the value of every variable it knows into its compile cache key; a new
    threshold must not recompile the model."""
    register()
    monkeypatch.setenv("VLLM_ENABLE_HPKV", "1")
    monkeypatch.setenv("VLLM_HPKV_TOKEN_THRESHOLD", "1204")
    before = envs.compile_factors()
    monkeypatch.setenv("VLLM_HPKV_TOKEN_THRESHOLD", "auto")
    monkeypatch.setenv("VLLM_ENABLE_HPKV", "0")
    assert envs.compile_factors() == before
