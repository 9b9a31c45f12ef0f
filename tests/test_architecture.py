"""The dependency rule of docs/architecture.md: an engine process imports nothing server-side."""

import json
import subprocess
import sys

ENGINE_MODULES = [
    "hpkv.integrations.vllm.plugin",
    "hpkv.integrations.vllm.connector",
    "hpkv.integrations.vllm.scheduler",
    "hpkv.integrations.vllm.worker",
    "hpkv.integrations.sglang.plugin",
    "hpkv.integrations.sglang.backend",
    "hpkv.costmodel",
]
SERVER_SIDE = (
    "hpkv.store",
    "hpkv.storage",
    "hpkv.server.daemon",
    "hpkv.server.handlers",
    "hpkv.server.connection",
    "hpkv.pool.tier",
    "hpkv.limits",
)


def test_an_engine_process_imports_nothing_from_the_store_or_the_storage_tier():
    code = (
        f"import importlib, json, sys\nfor m in {ENGINE_MODULES!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('hpkv'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(ENGINE_MODULES) <= set(loaded)
    leaked = [m for m in loaded if any(m == s or m.startswith(s + ".") for s in SERVER_SIDE)]
    assert leaked == []
