"""Per-request opt-out on a real vLLM (`integrations/vllm/optout.py`): a request whose
`kv_transfer_params` say `"hpkv_save": false` leaves nothing in HPKV; one that says
`"hpkv_load": false` is recomputed though HPKV holds its whole prefix; both: neither. One engine
start serves every story."""

from __future__ import annotations

import pytest

from helpers.server import server_stats
from helpers.storage import kv_files, settled_files
from helpers.vllm import Engine, num_saved_blocks
from helpers.vllm_node import engine_node, stop_engines
from hpkv.demo.model import prompt_text

pytestmark = [
    pytest.mark.engine,
    pytest.mark.vllm,
    pytest.mark.timeout(1200),
]

NO_SAVE = {"kv_transfer_params": {"hpkv_save": False}}
NO_LOAD = {"kv_transfer_params": {"hpkv_load": False}}
NEITHER = {"kv_transfer_params": {"hpkv_load": False, "hpkv_save": False}}


@pytest.fixture(scope="module")
def place(tmp_path_factory):
    extra = {"VLLM_HPKV_TOKEN_THRESHOLD": "256"}
    with engine_node(tmp_path_factory.mktemp("vllm-optout"), "hpkv-optout-", extra) as place:
        yield place


@pytest.fixture(scope="module")
def node(place):
    return place.root, place.shm


@pytest.fixture(scope="module")
def engine(place, model):
    engine = Engine("optout", model, place.env(), place.logs).start()
    yield engine
    stop_engines(engine, shm=place.shm)


def _hpkv_tokens(engine: Engine, prompt: str, **extra) -> float:
    """Reset vLLM's own prefix cache, send: the prompt tokens HPKV supplied (DRAM or storage)."""
    engine.reset_prefix_cache()
    before = engine.counters()
    engine.complete(prompt, **extra)
    got = engine.counters() - before
    return got["hit_tokens_dram"] + got["hit_tokens_storage"]  # HPKV's own counters: every tested vLLM has them


def test_no_save_leaves_nothing_and_no_load_recomputes_a_held_prefix(engine, node):
    root, shm = node
    private, public, neither = (prompt_text(700, seed=s) for s in (221, 222, 223))

    engine.complete(private, **NO_SAVE)
    engine.complete(neither, **NEITHER)
    answer = engine.complete(public)  # saved behind the others: once its files are in, theirs would be
    files = settled_files(root / "storage", at_least=num_saved_blocks(answer))
    assert len(files) == num_saved_blocks(answer)  # the public prompt's alone
    assert server_stats(shm).dram.num_entries == num_saved_blocks(answer)

    assert _hpkv_tokens(engine, public) > 0  # HPKV holds the public prefix...
    assert _hpkv_tokens(engine, public, **NO_LOAD) == 0  # ...and a no-load request recomputes it
    assert _hpkv_tokens(engine, public, **NEITHER) == 0
    assert _hpkv_tokens(engine, private) == 0  # never saved: nothing to hit (this send saves it)
    assert kv_files(root / "storage") >= files


def test_every_vllm_series_the_dashboard_queries_is_exported_by_vllm(engine):
    """docs/grafana/hpkv.json's vLLM panels read series this vLLM (with HPKV) exports."""
    import vllm

    from helpers.dashboard import queried_series
    from hpkv.integrations.versions import parse

    exported = {name.split("{")[0] for name in engine.server.metrics()}
    queried = queried_series("vllm:")
    if (parse(vllm.__version__) or ()) < (0, 32):  # the hit-by-source panel says it needs vLLM 0.32
        queried -= {"vllm:prompt_tokens_cached_by_source_total"}
    assert queried <= exported, queried - exported
