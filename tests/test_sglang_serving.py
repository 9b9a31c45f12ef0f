"""The documented SGLang scenarios on a real serving SGLang 0.5.23 with `--enable-ct-hpkv`, over
HTTP, on this CPU (`.venv-sglang`, with the test-only CPU layer of tests/sglang_cpu/).

One engine (`python -m sglang.launch_server`, the flag between `--model-path` and the path, as
the original document has it) serves: the quick start, a DRAM hit after `/flush_cache` identical
to SGLang's own device hit, a prompt below VLLM_HPKV_TOKEN_THRESHOLD not loaded, and the HPKV
server SIGKILLed during requests (compared with a fault-free run of the same requests). Then the
engine restarts as `sglang serve --model-path MODEL --enable-ct-hpkv` on the same storage, under
SGLang's default `timeout` prefetch policy and with SGLang's page-hash extension still to build
(as in a new container): HPKV's server is up once the engine answers and the extension is built
(the backend does both at registration, so that no lookup waits for either), and the first
request is a storage hit, identical. The oracle is SGLang's own device-cache hit: same token
ids, bit-identical logprobs. Where a hit came from: the response's
`meta_info.cached_tokens_details` and the HPKV server's per-namespace counters (`hpkv status`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from helpers import sglang_serving as ss
from helpers.cli import hpkv
from helpers.env import without_hpkv
from helpers.server import kill_server, server_pid, server_stats
from helpers.waiting import wait_for
from hpkv.demo.model import build_model, prompt_text
from hpkv.server import protocol

pytestmark = [pytest.mark.engine, pytest.mark.sglang]

LONG = 2000  # words, about one token each: above the documented 1204-token threshold
SHORT = 600


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    ss.require_sglang_venv()
    work = tmp_path_factory.mktemp("sglang-serving")
    shm = Path(tempfile.mkdtemp(prefix="hpkv-sglang-", dir="/dev/shm"))
    yield work, shm, ss.hpkv_env(shm, work / "storage", work)
    shutil.rmtree(shm, ignore_errors=True)


@pytest.fixture(scope="module")
def sglang_model():
    return build_model(Path(tempfile.gettempdir()) / f"hpkv-sglang-model-{os.getuid()}")


@pytest.fixture(scope="module")
def first(work, sglang_model):
    """The first engine, with `--hicache-storage-prefetch-policy wait_complete` (the helper's
    default): no hit here depends on how loaded the machine is."""
    path, _, env = work
    engine = ss.SglangEngine("first", sglang_model, env, path, flag_after_model_path=True)
    try:
        engine.start()
        yield engine
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def references(first):
    """SGLang's own device-cache hit for each prompt: sent twice, the second answer, taken
    before anything was loaded from HPKV (a second send after a load would reuse the load)."""
    refs = {}
    for name, words, seed in [("long", LONG, 1), ("short", SHORT, 2), ("a", LONG, 3), ("b", LONG, 4)]:
        text = prompt_text(words, seed)
        cold = first.complete(text)
        assert cold.cached["total"] == 0, f"{name}: cold, yet {cold.cached}"
        refs[name] = (text, first.complete(text))
        assert refs[name][1].cached.get("device", 0) > 0
    backed = sum(ss.full_pages(r.prompt_tokens) for _, r in refs.values())
    first.wait_backed_up(backed)
    return refs


def namespace_hits(shm: Path) -> dict[str, int]:
    stats = server_stats(shm)
    assert stats is not None, "no HPKV server answers"
    out = {"lookups": 0, "dram": 0, "storage": 0}
    for ns in stats.namespaces.values():
        if json.loads(ns.desc).get("engine") == "sglang":
            out["lookups"] += ns.lookups
            out["dram"] += ns.hit_keys_dram
            out["storage"] += ns.hit_keys_storage
    return out


def test_the_quick_start_command_line_serves_with_hpkv_as_sglangs_storage(first, references, work):
    cmd = first.server.command()
    assert cmd[1:5] == ["-m", "sglang.launch_server", "--model-path", ss.HPKV_FLAG]
    assert "--hicache-mem-layout" not in cmd and "--hicache-io-backend" not in cmd  # the flag's to pick
    log = first.log_text()
    assert "HPKV storage for SGLang: namespace" in log, first.log_tail()
    assert "[sglang_cpu_compat]" in log  # the test-only CPU layer says what it patched
    _, shm, env = work
    status = hpkv({**without_hpkv(), **env}, "status")
    assert status.returncode == 0 and "sglang" in status.stdout, status.stdout + status.stderr


def test_after_flush_cache_a_long_prompt_is_a_dram_hit_identical_to_sglangs_own(first, references, work):
    text, reference = references["long"]
    before = namespace_hits(work[1])
    first.flush_cache()
    hit = first.complete(text)
    pages = ss.full_pages(reference.prompt_tokens) // ss.PAGE_SIZE
    assert hit.cached.get("storage") == pages * ss.PAGE_SIZE, hit.cached
    assert hit.cached.get("storage_backend") == "HpkvStorage", hit.cached
    assert hit.cached.get("device", 0) == 0 and hit.cached.get("host", 0) == 0, hit.cached
    assert ss.same_output(hit, reference), (hit, reference)
    after = namespace_hits(work[1])
    assert after["dram"] - before["dram"] >= pages and after["storage"] == before["storage"]
    assert first.server.cached_tokens_by_source().get("storage", 0) >= pages * ss.PAGE_SIZE


def test_a_prompt_below_the_token_threshold_is_not_loaded_from_hpkv(first, references, work):
    text, reference = references["short"]
    assert ss.PAGE_SIZE * 2 < reference.prompt_tokens < 1204
    before = namespace_hits(work[1])
    first.flush_cache()
    again = first.complete(text)
    assert again.cached.get("storage", 0) == 0 and again.cached["total"] == 0, again.cached
    assert ss.same_output(again, reference)
    assert namespace_hits(work[1]) == before  # SGLang did not even ask


def _flush_and_send(engine, texts, during=None):
    """/flush_cache, then each prompt in turn (one at a time: a batch could change the
    numerics); `during()` runs while the second is in flight, its L3 lookup under way."""
    engine.flush_cache()
    out = []
    with ThreadPoolExecutor(1) as pool:
        for i, text in enumerate(texts):
            sent = pool.submit(engine.complete, text)
            if i == 1 and during is not None:
                time.sleep(0.05)
                during()
            out.append(sent.result())  # an HTTP error fails the test here
    return out


def test_the_hpkv_server_killed_during_requests_fails_none_and_changes_no_output(first, references, work):
    _, shm, _ = work
    names = ["a", "b", "long"]
    texts = [references[n][0] for n in names]
    control = _flush_and_send(first, texts)
    assert all(c.cached.get("storage", 0) > 0 for c in control), [c.cached for c in control]
    old = server_pid(shm)
    assert old is not None
    faulty = _flush_and_send(first, texts, during=lambda: kill_server(old))
    for name, c, f in zip(names, control, faulty):
        assert ss.same_output(f, c), f"{name}: output changed after the HPKV server was killed"
        assert ss.same_output(f, references[name][1])
    # HPKV serves again: the backend's next lookups auto-start a new server, and a new prompt's
    # pages stored through it come back as a hit.
    text = prompt_text(LONG, 5)
    first.complete(text)
    reference = first.complete(text)
    hits = []

    def stored_and_hit() -> bool:
        first.flush_cache()
        hits.append(first.complete(text))
        return hits[-1].cached.get("storage", 0) > 0

    wait_for(stored_and_hit, timeout_s=120, interval_s=1.0, what="a storage hit through a new HPKV server")
    assert server_pid(shm) not in (None, old)
    assert all(ss.same_output(hit, reference) for hit in hits)


def test_after_a_restart_a_long_prompt_is_a_storage_hit_identical_to_sglangs_own(first, references, work, sglang_model):
    path, shm, env = work
    first.stop()
    wait_for(lambda: not (shm / protocol.SOCKET_NAME).exists(), timeout_s=120, interval_s=0.5, what="HPKV exit")
    # SGLang's default prefetch policy (`timeout`: 1 s + 0.25 s per 1K tokens), and SGLang's
    # page-hash extension still to build, as in a new container or after an upgrade: HPKV builds
    # it at registration, or the first lookup would wait 15-20 s for g++ and miss.
    extensions = path / "torch-extensions-second"
    second_env = {**env, "TORCH_EXTENSIONS_DIR": str(extensions)}
    second = ss.SglangEngine("second", sglang_model, second_env, path, launcher="serve", extra_flags=())
    try:
        second.start()
        # Started in the background at the backend's registration, before any lookup.
        wait_for(
            lambda: server_pid(shm) is not None, timeout_s=30, interval_s=0.5, what="HPKV's server, no request sent"
        )
        cmd = second.server.command()
        assert cmd[1:5] == ["serve", "--model-path", str(sglang_model), ss.HPKV_FLAG]
        text, reference = references["long"]
        hit = second.complete(text)
        pages = ss.full_pages(reference.prompt_tokens) // ss.PAGE_SIZE
        assert hit.cached.get("storage") == pages * ss.PAGE_SIZE, hit.cached
        assert ss.same_output(hit, reference)
        assert namespace_hits(shm)["storage"] >= pages
        assert list(extensions.glob("*/*.so")), "no page hash was built: the restart did not need one"
    finally:
        second.stop()
