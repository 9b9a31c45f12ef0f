"""One node, one HPKV server, two engines at once: a real vLLM (HpkvConnectorV1) and a real
serving SGLang (`--enable-ct-hpkv`), with the same HPKV settings, serving the same model files
and the same prompts. `hpkv status` lists both engines' clients and namespaces; each gets its
own hits (vLLM after /reset_prefix_cache, SGLang after /flush_cache); neither ever loads the
other's KV, though the server holds both (the namespaces differ by engine and layout).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from helpers import sglang_serving as ss
from helpers.cli import hpkv
from helpers.engines import stop_all
from helpers.env import without_hpkv
from helpers.server import kill_server, server_pid, server_stats
from helpers.vllm import Engine, without_hpkv_environ
from hpkv.demo.model import build_model, prompt_text

pytestmark = [pytest.mark.engine, pytest.mark.vllm, pytest.mark.sglang]

LONG = 2000


@pytest.fixture(scope="module")
def engines(tmp_path_factory, model):
    """vLLM and SGLang started side by side on one HPKV environment."""
    ss.require_sglang_venv()
    work = tmp_path_factory.mktemp("sglang-vllm")
    shm = Path(tempfile.mkdtemp(prefix="hpkv-shared-", dir="/dev/shm"))
    env = ss.hpkv_env(shm, work / "storage", work)
    sglang_model = build_model(Path(tempfile.gettempdir()) / f"hpkv-sglang-model-{os.getuid()}")
    sglang = ss.SglangEngine("shared", sglang_model, env, work)
    vllm = Engine("shared", model, {**env, "VLLM_ENABLE_HPKV": "1"}, work)
    with without_hpkv_environ(), ThreadPoolExecutor(2) as pool:
        try:
            for started in [pool.submit(sglang.start), pool.submit(vllm.start)]:
                started.result()
            yield vllm, sglang, shm, env
        finally:
            pid = server_pid(shm)
            stop_all([vllm, sglang])
            kill_server(pid)
            shutil.rmtree(shm, ignore_errors=True)


def test_each_engine_gets_its_own_hits_and_never_the_others(engines):
    vllm, sglang, shm, env = engines
    p, q = prompt_text(LONG, 11), prompt_text(LONG, 12)
    # vLLM computes P and stores it; SGLang then computes P too: nothing of vLLM's is loaded.
    vllm.complete(p)
    before = vllm.counters()
    vllm_reference = vllm.complete(p)  # vLLM's own device hit
    cold_p = sglang.complete(p)
    assert cold_p.cached["total"] == 0, f"SGLang took cached tokens for vLLM's prompt: {cold_p.cached}"
    # SGLang computes Q and stores it; vLLM then computes Q: nothing of SGLang's is loaded.
    sglang.complete(q)
    sglang_reference = sglang.complete(q)
    sglang.wait_backed_up(ss.full_pages(cold_p.prompt_tokens) + ss.full_pages(sglang_reference.prompt_tokens))
    mark = vllm.counters()
    vllm.complete(q)
    took = vllm.counters() - mark
    assert took["host"] == 0 and took["disk"] == 0, f"vLLM loaded SGLang's KV: {took.values}"
    # Each engine's own hit, from the pool they share.
    vllm.reset_prefix_cache()
    mark = vllm.counters()
    vllm_hit = vllm.complete(p)
    took = vllm.counters() - mark
    assert took["host"] > 0, f"no DRAM hit for vLLM: {took.values}"
    assert vllm_hit.token_ids == vllm_reference.token_ids and vllm_hit.logprobs == vllm_reference.logprobs
    sglang.flush_cache()
    sglang_hit = sglang.complete(q)
    assert sglang_hit.cached.get("storage", 0) > 0, sglang_hit.cached
    assert ss.same_output(sglang_hit, sglang_reference)
    assert before["host"] == 0


def test_hpkv_status_lists_both_engines_clients_and_namespaces(engines):
    vllm, sglang, shm, env = engines
    stats = server_stats(shm)
    assert stats is not None
    kinds = {client.kind.split("-")[0] for client in stats.clients}
    assert {"vllm", "sglang"} <= kinds, kinds
    namespace_engines = {json.loads(ns.desc).get("engine") for ns in stats.namespaces.values()}
    assert {"vllm", "sglang"} <= namespace_engines, namespace_engines
    shown = hpkv({**without_hpkv(), **env, "COLUMNS": "200"}, "status")
    assert shown.returncode == 0, shown.stderr
    for kind in ("vllm-", "sglang-"):
        assert kind in shown.stdout, shown.stdout
