"""Namespaces are bounded (issue 31, row 8): a description's size, the namespaces one uid holds
registered and the namespaces the server holds in all, each refused past its limit with an error
naming the key that raises it; and what one client registered goes when it does, so that a client
that registered namespaces until none was left cannot keep new models out until a restart.
Against a real `hpkv server` process."""

from __future__ import annotations

import dataclasses
import json

import pytest

from helpers.cli import DESC, ServerProcess, hpkv, hpkv_env, wait_for_storage, write_entries
from hpkv.server.client import ServerError
from hpkv.tiers import Tier

PER_UID = 16
TOTAL = 24


@pytest.fixture
def server(pool_dir, tmp_path, request):
    """A server with the limits PER_UID, TOTAL and 4 KiB descriptions, or those the test's param
    (a dict of settings) changes."""
    limits = {
        "HPKV_SERVER_MAX_NAMESPACES_PER_UID": str(PER_UID),
        "HPKV_SERVER_MAX_NAMESPACES": str(TOTAL),
        "HPKV_SERVER_MAX_NAMESPACE_BYTES": "4k",
    }
    env = hpkv_env(pool_dir, tmp_path / "storage", tmp_path, **(limits | getattr(request, "param", {})))
    process = ServerProcess(env, tmp_path / "server.log")
    yield process
    process.stop()


def model(name: str):
    return dataclasses.replace(DESC, model=f"HPKV_MODEL_ID:{name}")


def test_a_client_that_registers_namespaces_until_refused_keeps_no_new_model_out_once_it_is_gone(server):
    with server.client() as greedy, server.client() as same_uid:
        for i in range(PER_UID):
            ns = greedy.register(model(f"greedy-{i}"))
            assert greedy.lookup(ns, [b"k" * 16]).num_hit == 0
        with pytest.raises(ServerError, match=f"HPKV_SERVER_MAX_NAMESPACES_PER_UID={PER_UID}"):
            greedy.register(model("one-more"))
        with pytest.raises(ServerError, match="HPKV_SERVER_MAX_NAMESPACES_PER_UID"):
            same_uid.register(model("another-connection-of-that-uid"))
        same_uid.register(model("greedy-0"))  # one the uid holds already: no new namespace
    with server.client() as engine:
        ns = engine.register(model("a-new-model"))
        assert engine.lookup(ns, [b"k" * 16]).num_hit == 0
        assert len(engine.stats().namespaces) == 1  # the greedy client's went with it


@pytest.mark.parametrize("server", [{"HPKV_SERVER_MAX_NAMESPACES_PER_UID": "100"}], indirect=True)
def test_at_the_server_limit_namespaces_no_client_holds_make_room_and_their_files_stay(server):
    num_gone = 16
    with server.client() as gone:
        written = [write_entries(gone, 1, model(f"gone-{i}")) for i in range(num_gone)]
        wait_for_storage(gone, num_gone)
    with server.client() as client:
        for i in range(TOTAL - num_gone):
            client.register(model(f"live-{i}"))
        assert len(client.stats().namespaces) == TOTAL  # the gone client's, with entries in DRAM, stay

        client.register(model("past-the-limit"))  # the gone client's make room

        assert len(client.stats().namespaces) <= TOTAL
        ns, keys = written[0]
        assert client.register(model("gone-0")) == ns
        assert client.lookup(ns, keys).tiers == (Tier.STORAGE,)  # dropped from DRAM, still on storage
        with pytest.raises(ServerError, match=f"HPKV_SERVER_MAX_NAMESPACES={TOTAL}"):
            for i in range(TOTAL):  # every namespace held by a live client: one is refused
                client.register(model(f"more-{i}"))


def test_a_description_larger_than_the_limit_is_refused_with_the_key_to_raise_it(server):
    with server.client() as client:
        large = dataclasses.replace(model("m"), extra=(("quantization_config", "x" * 5000),))
        with pytest.raises(ServerError, match=r"HPKV_SERVER_MAX_NAMESPACE_BYTES=4096"):
            client.register(large)
        client.register(model("m"))


@pytest.mark.parametrize(
    "server", [{"HPKV_SERVER_MAX_NAMESPACE_BYTES": "1m", "HPKV_SERVER_MAX_NAMESPACES_PER_UID": "100"}], indirect=True
)
def test_stats_status_and_clear_answer_with_namespaces_whose_descriptions_exceed_a_frame_together(server):
    """20 namespaces of 1 MiB descriptions each (issue 31, row 9): a Stats reply with all of them
    would be 20 MiB, past the 16 MiB frame; it comes in pages, and `hpkv status`, its `--json`
    and `hpkv clear --model` answer."""
    num = 20
    with server.client() as client:
        descs = [
            dataclasses.replace(model(f"big-{i}"), extra=(("quantization_config", "x" * ((1 << 20) - 400)),))
            for i in range(num)
        ]
        written = [write_entries(client, 1, desc) for desc in descs]
        stats = client.stats()
        assert 0 < len(stats.namespaces) < num and stats.namespace_summary.total == num
        assert set(client.all_stats().namespaces) == {ns for ns, _ in written}

        status = hpkv(server.env, "status")
        assert status.returncode == 0, status.stderr
        assert f"{num} namespaces ({num} registered by clients connected now)" in " ".join(status.stdout.split())
        as_json = hpkv(server.env, "status", "--json")
        assert as_json.returncode == 0, as_json.stderr
        assert len(json.loads(as_json.stdout)["namespaces"]) == num
        cleared = hpkv(server.env, "clear", "--model", "big-7")
        assert cleared.returncode == 0, cleared.stderr
        assert client.lookup(*written[7]).num_hit == 0 and client.lookup(*written[8]).num_hit == 1
