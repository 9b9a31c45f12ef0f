"""A model's identity on real vLLM engines sharing one storage directory, three engine starts:

- A serves a prompt at path P, and its KV lands on storage; A stops (and its HPKV server).
- Model B, A with 200 embedding rows retuned (the rows of the prompt's first 200 distinct
  tokens; every other byte as it was: a partial fine-tune), is put at P, and a copy of A made
  before sits at Q. Two engines start side by side over the same storage directory: B at P on
  node 1, and A's copy at Q on node 2 (a pool directory of its own: another node).
- Once each knows its model's identity, B at P gets no HPKV hit for the prompt and answers as B
  (its own KV); the copy at Q gets storage hits from A's files and answers exactly as A did.

Before model identity the namespace was the model path: B was served A's KV, Q missed; before
identity by every byte, a checkpoint over 8 MiB was sampled and B was served A's KV (issue 31).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from helpers.engines import stop_all
from helpers.processes import wait_gone
from helpers.server import kill_server, server_pid, server_stats
from helpers.storage import settled_files
from helpers.vllm import Engine, num_saved_blocks, retune_rows, same_output, start_all, without_hpkv_environ
from helpers.waiting import wait_for
from hpkv.demo.model import prompt_text

pytestmark = [
    pytest.mark.engine,
    pytest.mark.vllm,
    pytest.mark.timeout(1200),
]

# Kept between runs (vLLM caches its compile by model path); their weights are written anew.
PATH_P = Path(tempfile.gettempdir()) / f"hpkv-identity-p-{os.getuid()}"
PATH_Q = Path(tempfile.gettempdir()) / f"hpkv-identity-q-{os.getuid()}"


PROMPT = prompt_text(800, seed=71)


@pytest.fixture(scope="module")
def place(tmp_path_factory):
    with without_hpkv_environ():
        root = tmp_path_factory.mktemp("identity-e2e")
        shms = [Path(tempfile.mkdtemp(prefix=f"hpkv-id{i}-", dir="/dev/shm")) for i in (1, 2)]
        (root / "storage").mkdir()
        (root / "logs").mkdir()
        yield root, shms
        for shm in shms:
            kill_server(server_pid(shm))
            shutil.rmtree(shm, ignore_errors=True)


def env(root: Path, shm: Path) -> dict[str, str]:
    return {
        "VLLM_ENABLE_HPKV": "1",
        "HPKV_KV_MEM_POOL_SIZE": "256m",
        "HPKV_SHARE_MEM_FILE_PATH": str(shm),
        "HPKV_KV_STORAGE_PATH": str(root / "storage"),
        "HPKV_SERVER_IDLE_EXIT_S": "2",
        "VLLM_HPKV_TOKEN_THRESHOLD": "0",
        "HPKV_CONFIG_FILE_PATH": str(root / "no-config.ini"),
    }


def test_new_weights_at_the_path_get_their_own_kv_and_a_copy_elsewhere_shares(place):
    from hpkv.demo.model import build_model

    root, (shm1, shm2) = place
    for path in (PATH_P, PATH_Q):
        shutil.rmtree(path, ignore_errors=True)
    build_model(PATH_P)
    shutil.copytree(PATH_P, PATH_Q)  # A on a second node

    a = Engine("a-at-p", PATH_P, env(root, shm1), root / "logs")
    try:
        a.start()
        first = a.complete(PROMPT)
        settled_files(root / "storage", at_least=num_saved_blocks(first))
        a_answer = a.reference(PROMPT)  # A's own prefix-cache hit: no HPKV load on this engine yet
        retuned = list(dict.fromkeys(a.tokenize(PROMPT)))[:200]
    finally:
        pid = server_pid(shm1)
        a.stop()
        if pid is not None:
            wait_gone(pid, timeout_s=30)

    assert len(retuned) == 200
    retune_rows(PATH_P, retuned, seed=2)  # model B where A was
    b = Engine("b-at-p", PATH_P, env(root, shm1), root / "logs")
    copy = Engine("a-at-q", PATH_Q, env(root, shm2), root / "logs")
    try:
        start_all([b, copy])
        wait_for(lambda: server_stats(shm2).storage.index_ready, timeout_s=60, what="node 2's storage index")
        for engine in (b, copy):  # until then an engine loads and saves nothing
            wait_for(lambda e=engine: "HPKV model identity known" in e.log_text(), timeout_s=60, what="the identity")

        before = b.counters()
        b_answer = b.complete(PROMPT)
        got = b.counters() - before
        assert got["disk"] == got["host"] == 0, "B was served A's KV"
        assert not same_output(b_answer, a_answer)  # computed by B alone: B's own answer, not A's

        before = copy.counters()
        copy_answer = copy.complete(PROMPT)
        got = copy.counters() - before
        assert got["disk"] > 0 and got["host"] == 0, "the copy at another path missed A's files"
        assert same_output(copy_answer, a_answer)
    finally:
        pids = [server_pid(shm) for shm in (shm1, shm2)]
        stop_all([b, copy])
        for pid in pids:
            kill_server(pid)
