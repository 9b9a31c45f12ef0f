"""vLLM plugin: registers HpkvConnectorV1 in every vLLM process (a `vllm.general_plugins` entry
point), so `"kv_connector":"HpkvConnectorV1"` works with no module path.

vLLM calls this unguarded in every process: it must be idempotent, import nothing heavy and
never raise. The name is always registered; whether HPKV may run is decided (and explained)
by the connector itself, so a user who asks for it without VLLM_ENABLE_HPKV=1 gets a message
naming the variable instead of "Unsupported connector type". Outside the tested vLLM range
(`hpkv.integrations.versions`) it first says so in one line; a registration that then fails is
one more line, not a traceback from inside vLLM.
"""

from __future__ import annotations

import logging

from ..versions import outside_tested, warn_once

log = logging.getLogger("hpkv.vllm")

CONNECTOR_NAME = "HpkvConnectorV1"
_OUR_ENV = ("VLLM_ENABLE_HPKV", "VLLM_HPKV_TOKEN_THRESHOLD")


def register() -> None:
    version = vllm_version()
    warn_once(log, "vLLM", version)
    try:
        from vllm import envs
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        if CONNECTOR_NAME not in KVConnectorFactory._registry:
            KVConnectorFactory.register_connector(CONNECTOR_NAME, "hpkv.integrations.vllm.connector", CONNECTOR_NAME)
        for name in _OUR_ENV:
            # Known to vLLM, so its check of VLLM_* variables doesn't call them unknown. The getter
            # gives None, not the value: vLLM hashes every getter's value into its compile cache
            # key, and neither variable changes a compiled graph (tuning the threshold must not
            # recompile the model). HPKV reads them through hpkv.config.
            envs.environment_variables.setdefault(name, _none)
        _log_like_vllm()
    except Exception as exc:  # never break vLLM's start-up
        if outside_tested("vLLM", version) is None:
            log.exception("HPKV could not register %s with vLLM", CONNECTOR_NAME)
        else:
            log.warning(
                "HPKV could not register %s with vLLM %s: %s: %s", CONNECTOR_NAME, version, type(exc).__name__, exc
            )


def vllm_version() -> str:
    """The running vLLM's version string, read without importing more of vLLM than its package."""
    try:
        import vllm

        return str(vllm.__version__)
    except Exception:  # an install too broken to say: the check calls it unreadable
        return "unknown"


def _none() -> None:
    return None


def _log_like_vllm() -> None:
    """HPKV's log lines go wherever vLLM's go, at HPKV_LOG_LEVEL."""
    ours, theirs = logging.getLogger("hpkv"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.propagate = False
    try:
        from ...config import load_settings

        ours.setLevel(load_settings().log_level.upper())
    except Exception:  # a bad config is reported by the connector, with its fix
        ours.setLevel(logging.INFO)
