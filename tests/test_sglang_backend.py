"""HpkvStorage as SGLang builds and calls it: through SGLang's real storage factory, with SGLang's
real host KV pools, against a real HPKV server. Pages go in from one pool and come back
byte-identical into another; only a reader of the very same layout, dtype and shard ever hits;
pages survive a server restart on storage; a vLLM engine on the node never sees them."""

from __future__ import annotations

import json
import logging
import shutil
import signal
import threading
from types import SimpleNamespace

import pytest
import torch

from helpers import sglang as su
from helpers.waiting import wait_for
from hpkv.errors import ConfigError
from hpkv.integrations.sglang import flag
from hpkv.keys import NamespaceDesc, make_key
from hpkv.tiers import Tier

PAGES = 6


@pytest.fixture
def node(node, monkeypatch):
    su.use_node_env(monkeypatch, node)
    node.start_server()
    return node


def write_pages(storage, pool, keys, pages=None):
    pages = list(range(len(keys))) if pages is None else pages
    return storage.batch_set_v1(keys, su.page_indices(pool, pages))


def test_sglangs_factory_builds_hpkv_from_the_flags_extra_config(node):
    """From the documented command line to a backend, through SGLang's own parsers."""
    from sglang.srt.server_args import prepare_server_args

    sg = su.sglang_modules()
    with su.root_logging_kept():
        args = prepare_server_args(flag.rewrite_argv(su.GPU_ARGV))
    extra, threshold, *_ = sg.hybrid_controller.HybridCacheController.parse_storage_backend_extra_config(
        args.hicache_storage_backend_extra_config
    )
    assert threshold == 1204
    config = su.storage_config(model_name=args.served_model_name, extra=extra)
    storage = sg.factory.StorageBackendFactory.create_backend(args.hicache_storage_backend, config, None)
    assert type(storage).__name__ == "HpkvStorage"
    assert isinstance(storage, sg.hicache_storage.HiCacheStorage)
    storage.close()


@pytest.mark.parametrize(
    "kind,layout", [("mha", "page_first"), ("mha", "layer_first"), ("mla", "page_first"), ("mla", "layer_first")]
)
def test_pages_come_back_byte_identical_into_a_fresh_pool(node, kind, layout):
    source = su.host_pool(kind, layout, seed=1)
    keys = su.page_hashes("a long shared system prompt", PAGES)
    writer = su.backend(source, su.storage_config(is_mla=kind == "mla"))
    assert write_pages(writer, source, keys, pages=[3, 4, 5, 6, 7, 8]) == [True] * PAGES

    fresh = su.host_pool(kind, layout, seed=None)
    reader = su.backend(fresh, su.storage_config(is_mla=kind == "mla"))
    assert reader.batch_exists(keys) == PAGES
    assert reader.batch_get_v1(keys, su.page_indices(fresh, [10, 2, 11, 12, 13, 14])) == [True] * PAGES
    for src, dst in zip([3, 4, 5, 6, 7, 8], [10, 2, 11, 12, 13, 14]):
        assert su.page_bytes(fresh, dst * 4) == su.page_bytes(source, src * 4)
    zeros = bytes(len(su.page_bytes(fresh, 0)))
    untouched = set(range(fresh.size // 4)) - {10, 2, 11, 12, 13, 14}
    assert all(su.page_bytes(fresh, p * 4) == zeros for p in untouched)  # nothing written past a page
    writer.close()
    reader.close()


def test_batch_exists_counts_the_leading_hits_only(node):
    pool = su.host_pool()
    storage = su.backend(pool)
    keys = su.page_hashes("prompt", 5)
    write_pages(storage, pool, [keys[0], keys[1], keys[3]])
    assert storage.batch_exists(keys) == 2
    assert storage.batch_exists(keys[3:]) == 1
    assert storage.batch_exists(su.page_hashes("another prompt", 3)) == 0
    assert storage.exists(keys[3]) and not storage.exists(keys[2])
    assert storage.batch_get_v1(keys[:3], su.page_indices(pool, [20, 21, 22])) == [True, True, False]
    storage.close()


def test_another_layout_dtype_or_rank_never_hits(node):
    """Same model, same keys: different bytes, so different namespaces. float16 has the size
    of bfloat16 and would load without complaint, scrambled."""
    keys = su.page_hashes("prompt", 3)
    pool = su.host_pool("mha", "page_first")
    write_pages(su.backend(pool), pool, keys)
    readers = {
        "layer_first": su.backend(su.host_pool("mha", "layer_first")),
        "float16": su.backend(su.host_pool("mha", "page_first", dtype=torch.float16)),
        "tp rank 1 of 2": su.backend(pool, su.storage_config(tp_rank=1, tp_size=2)),
        "pp rank 1 of 2": su.backend(pool, su.storage_config(pp_rank=1, pp_size=2)),
        "another model": su.backend(pool, su.storage_config(model_name="other-model")),
    }
    assert {what: r.batch_exists(keys) for what, r in readers.items()} == dict.fromkeys(readers, 0)
    assert su.backend(su.host_pool("mha", "page_first")).batch_exists(keys) == 3


def weights(model, seed: int):
    """A weight file in `model` (another seed: same names, shapes and size, other values)."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    save_file(
        {"model.embed_tokens.weight": torch.randn(1000, 64, generator=generator).to(torch.bfloat16)},
        model / "model.safetensors",
    )
    return model


def test_another_model_under_the_same_served_name_never_hits(node, tmp_path):
    """SGLang restarted under the same --served-model-name with another checkpoint, new weights
    at the same path, a `current` link switched, online quantization, a config override or
    random weights: the pages stored before are another model's KV. The served name and the
    path are only names: the same model under another name, or copied to another path, hits."""
    from hpkv import identity

    keys = su.page_hashes("prompt", 3)
    model, other = su.tiny_model(tmp_path / "model"), su.tiny_model(tmp_path / "fine-tune")
    weights(model, seed=1), weights(other, seed=2)
    current = tmp_path / "current"
    current.symlink_to(model)
    served = ["--served-model-name", su.SERVED]
    pool = su.host_pool()
    with su.published(["--model-path", current, *served]):
        write_pages(su.backend(pool), pool, keys)

    def hits(argv) -> int:
        identity.forget()  # as a new SGLang process: the files are read again
        with su.published(argv):
            return su.backend(pool).batch_exists(keys)

    restarts = {
        "another checkpoint": ["--model-path", other, *served],
        "quantized on load": ["--model-path", current, "--quantization", "fp8", *served],
        "a config override": [
            "--model-path",
            current,
            "--json-model-override-args",
            '{"rope_scaling": {"rope_type": "linear", "factor": 2.0}}',
            *served,
        ],
        "random weights": ["--model-path", current, "--load-format", "dummy", *served],
    }
    got = {what: hits(argv) for what, argv in restarts.items()}
    current.unlink()
    current.symlink_to(other)  # the deployment's "current" now names the fine-tune
    got["the symlink switched"] = hits(["--model-path", current, *served])
    shutil.copytree(model, tmp_path / "copy")
    weights(model, seed=3)  # new weights put where the model was
    got["new weights at the same path"] = hits(["--model-path", model, *served])
    assert got == dict.fromkeys(got, 0)
    # The copy made before: another path (another node's mount), another served name, a
    # revision (a local directory's content is what SGLang loads, whatever --revision says).
    assert hits(["--model-path", tmp_path / "copy", "--served-model-name", "an-alias", "--revision", "v2"]) == 3


def test_hpkv_model_id_names_the_model_in_place_of_its_files(node, tmp_path, monkeypatch):
    from hpkv import identity

    keys = su.page_hashes("prompt", 3)
    pool = su.host_pool()
    monkeypatch.setenv("HPKV_MODEL_ID", "team/qwen@7")
    one, two = su.tiny_model(tmp_path / "one"), su.tiny_model(tmp_path / "two")
    with su.published(["--model-path", one]):
        storage = su.backend(pool)
        write_pages(storage, pool, keys)
    assert storage.desc.model == "HPKV_MODEL_ID:team/qwen@7"
    assert dict(storage.desc.extra)["model_source"] == "HPKV_MODEL_ID"
    with su.published(["--model-path", two]):
        assert su.backend(pool).batch_exists(keys) == 3
    monkeypatch.setenv("HPKV_MODEL_ID", "team/qwen@8")
    identity.forget()
    with su.published(["--model-path", one]):
        assert su.backend(pool).batch_exists(keys) == 0


def test_a_lora_adapter_changed_at_its_path_names_another_namespace(tmp_path):
    """SGLang keys a --lora-paths adapter's pages by its name and path only (a stable id): its
    content is in HPKV's identity, so new adapter weights at the same path never hit."""
    from hpkv import identity
    from hpkv.integrations.sglang import modelid

    model = weights(su.tiny_model(tmp_path / "model"), seed=1)
    adapter = tmp_path / "adapters" / "sql"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16}))
    weights(adapter, seed=4)

    def ident(lora_paths):
        identity.forget()
        args = SimpleNamespace(model_path=str(model), load_format="auto", lora_paths=lora_paths)
        return modelid.model_identity(args, None).id

    forms = [["sql=" + str(adapter)], [{"lora_name": "sql", "lora_path": str(adapter)}], {"sql": str(adapter)}]
    before = {ident(form) for form in forms}
    assert len(before) == 1 and before != {ident(None)}
    weights(adapter, seed=5)
    assert ident(forms[0]) not in before


def test_without_sglangs_server_args_the_served_name_names_the_model(node, caplog):
    with caplog.at_level("WARNING", logger="hpkv.sglang"):
        storage = su.backend(su.host_pool())
    assert "--served-model-name" in caplog.text
    assert json.loads(storage.desc.to_json())["model"] == su.SERVED


def test_fp8_e4m3_and_fp8_e5m2_pages_never_mix(node, tmp_path):
    """SGLang keeps every fp8 KV format as uint8 bytes, in its device and host pools alike: only
    --kv-cache-dtype tells e4m3 from e5m2, whose bytes mean other numbers."""
    model = su.tiny_model(tmp_path / "model")
    keys = su.page_hashes("prompt", 3)
    storages = {}
    for name, dtype in (("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)):
        with su.published(["--model-path", model, "--kv-cache-dtype", name]):
            storages[name] = su.backend(su.host_pool(dtype=dtype))
    e4m3, e5m2 = storages["fp8_e4m3"], storages["fp8_e5m2"]
    assert e4m3.mem_pool_host.dtype == e5m2.mem_pool_host.dtype == torch.uint8
    assert write_pages(e4m3, e4m3.mem_pool_host, keys) == [True] * 3
    assert e4m3.batch_exists(keys) == 3 and e5m2.batch_exists(keys) == 0


def test_a_pipeline_stage_of_other_layers_never_hits(node):
    """PP rank 1 of 2 holds layers 3-5 of a 6-layer model, or 4-6 of a 7-layer one under
    another partition: the same number of layers, other layers."""
    keys = su.page_hashes("prompt", 3)
    config = su.storage_config(pp_rank=1, pp_size=2)
    stage = su.host_pool(start_layer=3)
    write_pages(su.backend(stage, config), stage, keys)
    assert su.backend(su.host_pool(start_layer=4), config).batch_exists(keys) == 0
    assert su.backend(su.host_pool(start_layer=3), config).batch_exists(keys) == 3


def test_mla_pages_written_by_rank_0_are_read_by_every_rank(node):
    keys = su.page_hashes("prompt", 3)
    pool = su.host_pool("mla", "page_first")
    rank0 = su.backend(pool, su.storage_config(is_mla=True, tp_rank=0, tp_size=4))
    write_pages(rank0, pool, keys)
    rank3 = su.backend(
        su.host_pool("mla", "page_first", seed=None), su.storage_config(is_mla=True, tp_rank=3, tp_size=4)
    )
    assert rank3.batch_exists(keys) == 3
    assert rank3.batch_get_v1(keys, su.page_indices(rank3.mem_pool_host, [0, 1, 2])) == [True] * 3
    assert su.page_bytes(rank3.mem_pool_host, 4) == su.page_bytes(pool, 4)


def test_pages_survive_a_server_restart_on_storage(node):
    """The documented storage hit: SGLang restarted (new host pool), the DRAM tier gone with its
    server, the same storage path: the repeated prompt is read from storage."""
    keys = su.page_hashes("a long document", PAGES)
    before = su.host_pool(seed=7)
    first = su.backend(before)
    write_pages(first, before, keys)
    first.close()
    server = node.servers[0]
    server.send_signal(signal.SIGTERM)  # finishes the write-throughs in flight, then exits
    assert server.wait(timeout=30) == 0
    node.start_server()

    after = su.host_pool(seed=None)
    second = su.backend(after)
    looking = node.client()
    looking.register(second.desc)
    assert looking.lookup(second.ns, [make_key(k) for k in keys]).tiers == (Tier.STORAGE,) * PAGES
    assert second.batch_exists(keys) == PAGES
    assert second.batch_get_v1(keys, su.page_indices(after, range(PAGES))) == [True] * PAGES
    assert all(su.page_bytes(after, p * 4) == su.page_bytes(before, p * 4) for p in range(PAGES))
    second.close()


def test_a_vllm_engine_on_the_node_never_sees_sglangs_pages(node):
    pool = su.host_pool()
    storage = su.backend(pool)
    keys = su.page_hashes("prompt", 3)
    fields = json.loads(storage.desc.to_json())
    vllm_desc = NamespaceDesc.from_json(json.dumps({**fields, "engine": "vllm"}))
    vllm = node.client("vllm-worker")
    vllm_ns = vllm.register(vllm_desc)
    assert vllm_ns != storage.ns
    entry_keys = [make_key(k) for k in keys]
    reservation = vllm.reserve(vllm_ns, entry_keys)  # vLLM stores first, under the very same keys
    for i in range(3):
        reservation.view(i)[:] = b"\x5a" * storage.layout.entry_bytes
    assert vllm.commit(reservation) == 3

    assert storage.batch_exists(keys) == 0
    assert write_pages(storage, pool, keys) == [True] * 3
    fresh = su.host_pool(seed=None)
    reader = su.backend(fresh)
    assert reader.batch_get_v1(keys, su.page_indices(fresh, [0, 1, 2])) == [True] * 3
    assert su.page_bytes(fresh, 0) == su.page_bytes(pool, 0)
    lease = vllm.lease(vllm_ns, entry_keys)
    assert vllm.wait(lease) == 3 and bytes(lease.view(2)) == b"\x5a" * storage.layout.entry_bytes
    vllm.release(lease)


def test_a_model_with_side_pools_stores_no_kv_pages(node, caplog):
    """A hybrid model (here a sliding-window pool beside the full-attention one): SGLang asks
    only batch_exists_v2, which HPKV answers with no hits, so KV pages stored for it would only
    take the pool's room from other engines."""
    sg = su.sglang_modules()
    pool = su.host_pool()
    storage = su.backend(pool)
    storage.register_mem_host_pool_v2(pool, sg.hicache_storage.PoolName.KV)
    storage.register_mem_host_pool_v2(su.host_pool(), sg.hicache_storage.PoolName.SWA)
    with caplog.at_level("WARNING", logger="hpkv.sglang"):
        storage.on_host_pools_registered()
    assert "['swa']" in caplog.text
    keys = su.page_hashes("prompt", 3)
    assert write_pages(storage, pool, keys) == [True] * 3  # reported stored: SGLang does not retry
    assert storage.batch_exists_v2(keys).kv_hit_pages == 0
    assert su.backend(pool).batch_exists(keys) == 0  # nothing went into the pool
    assert storage.stats.snapshot()["saved_pages"] == 0


def test_mla_with_layers_split_over_tp_ranks_stores_nothing(node, caplog):
    """Layer-sharded MLA: each TP rank holds other layers (so its own namespace), yet SGLang
    lets only rank 0 back up: the other ranks never hit, so rank 0's pages would be waste."""
    keys = su.page_hashes("prompt", 3)
    pool = su.host_pool("mla", layer_shard_enabled=True)
    with caplog.at_level("WARNING", logger="hpkv.sglang"):
        rank0 = su.backend(pool, su.storage_config(is_mla=True, tp_rank=0, tp_size=2))
    assert "layer sharding" in caplog.text
    assert write_pages(rank0, pool, keys) == [True] * 3
    assert rank0.batch_exists(keys) == 0
    rank1 = su.backend(
        su.host_pool("mla", layer_shard_enabled=True), su.storage_config(is_mla=True, tp_rank=1, tp_size=2)
    )
    assert rank1.ns != rank0.ns and rank1.batch_exists(keys) == 0


def test_clear_removes_this_namespace_only(node):
    pool = su.host_pool()
    keys = su.page_hashes("prompt", 3)
    ours, theirs = su.backend(pool), su.backend(pool, su.storage_config(model_name="other-model"))
    write_pages(ours, pool, keys)
    write_pages(theirs, pool, keys)
    ours.clear()
    assert ours.batch_exists(keys) == 0 and theirs.batch_exists(keys) == 3


def test_clear_keeps_the_scheduler_waiting_a_few_seconds_at_most(node, monkeypatch):
    """A server that does not answer (stopped here): SGLang's scheduler thread, which calls
    clear(), is back after CLEAR_WAIT_S; the clear finishes once the server answers."""
    from hpkv.integrations.sglang import backend as sglang_backend

    monkeypatch.setattr(sglang_backend, "CLEAR_WAIT_S", 1.0)
    pool = su.host_pool()
    storage = su.backend(pool)
    keys = su.page_hashes("prompt", 3)
    scheduler = threading.Thread(target=lambda: (write_pages(storage, pool, keys), stopped.wait(), storage.clear()))
    stopped = threading.Event()
    server = node.servers[0]
    scheduler.start()
    try:
        wait_for(lambda: storage.batch_exists(keys) == 3, 10, what="the pages stored")
        wait_for(lambda: node.client().stats().write_backlog.entries == 0, 10, what="the write-throughs")
        server.send_signal(signal.SIGSTOP)
        stopped.set()
        scheduler.join(timeout=6.0)
        assert not scheduler.is_alive(), "clear() held the scheduler thread"
    finally:
        server.send_signal(signal.SIGCONT)
        scheduler.join(timeout=30)
    wait_for(lambda: storage.batch_exists(keys) == 0, 30, what="the clear to finish")


def test_only_the_rank_that_writes_an_mla_namespace_clears_it(node):
    keys = su.page_hashes("prompt", 3)
    pool = su.host_pool("mla")
    ranks = [su.backend(pool, su.storage_config(is_mla=True, tp_rank=rank, tp_size=2)) for rank in (0, 1)]
    assert ranks[0].ns == ranks[1].ns
    write_pages(ranks[0], pool, keys)
    ranks[1].clear()  # SGLang asks every rank; rank 1 only reads
    assert ranks[1].batch_exists(keys) == 3
    ranks[0].clear()
    assert ranks[1].batch_exists(keys) == 0


def test_without_a_reachable_server_everything_is_a_miss(node, monkeypatch, tmp_path):
    """HPKV_SHARE_MEM_FILE_PATH unusable: no server can start; SGLang just recomputes."""
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    monkeypatch.setenv("HPKV_SHARE_MEM_FILE_PATH", str(not_a_dir))
    pool = su.host_pool()
    storage = su.backend(pool)
    keys = su.page_hashes("prompt", 2)
    assert storage.batch_exists(keys) == 0
    assert storage.batch_set_v1(keys, su.page_indices(pool, [0, 1])) == [False, False]
    assert storage.batch_get_v1(keys, su.page_indices(pool, [0, 1])) == [False, False]
    storage.clear()
    assert storage.stats.snapshot()["faults"] >= 3


def test_an_unexpected_error_is_logged_with_its_traceback_once_per_interval(node, caplog):
    """SGLang calling with host indices that are not whole pages (a bug somewhere): a miss,
    and one traceback per 30 s however often the three storage threads repeat the call."""
    pool = su.host_pool()
    storage = su.backend(pool)
    keys = su.page_hashes("prompt", 2)
    with caplog.at_level("DEBUG", logger="hpkv.sglang"):
        for _ in range(5):
            assert storage.batch_get_v1(keys, su.page_indices(pool, [0])) == [False, False]
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING and r.exc_info]
    assert len(loud) == 1 and "host indices" in caplog.text
    assert storage.stats.snapshot()["faults"] == 5


def test_stats_and_close(node):
    pool = su.host_pool()
    storage = su.backend(pool, su.storage_config(metrics=True))
    keys = su.page_hashes("prompt", 4)
    write_pages(storage, pool, keys)
    assert write_pages(storage, pool, keys) == [True] * 4  # held already: skipped, reported stored
    storage.batch_exists(keys)
    storage.batch_get_v1(keys, su.page_indices(pool, [10, 11, 12, 13]))
    counts = storage.stats.snapshot()
    assert (counts["saved_pages"], counts["save_skipped_pages"], counts["hit_pages_dram"], counts["loaded_pages"]) == (
        4,
        4,
        4,
        4,
    )
    metrics = storage.get_stats()
    assert metrics.backup_pgs == [4] and metrics.prefetch_pgs == [4] and len(metrics.prefetch_bandwidth) == 1
    assert storage.get_stats().backup_pgs == []  # drained
    storage.close()
    assert storage.batch_exists(keys) == 0


def test_the_backend_refuses_the_copying_interface():
    with pytest.raises(ConfigError, match="interface_v1"):
        su.backend(
            su.host_pool(),
            su.storage_config(
                extra={
                    "backend_name": "ct_hpkv",
                    "module_path": "hpkv.integrations.sglang.backend",
                    "class_name": "HpkvStorage",
                }
            ),
        )


def test_a_private_identity_is_shared_by_the_ranks_of_one_launch_and_no_other():
    """SGLang's TP ranks are processes of one launcher; an MLA model's ranks all read the pages
    rank 0 writes, so a private identity must be the launch's, not each rank process's."""
    import subprocess
    import sys

    child = "from hpkv.integrations.sglang.modelid import _PROCESS_SCOPE; print(_PROCESS_SCOPE)"
    launcher = (
        f"import subprocess, sys\nfor _ in range(2): subprocess.run([sys.executable, '-c', {child!r}], check=True)\n"
    )

    def launch() -> list[str]:
        out = subprocess.run([sys.executable, "-c", launcher], capture_output=True, text=True, check=True)
        return out.stdout.split()

    first, second = launch(), launch()
    assert len(set(first)) == 1 and len(set(second)) == 1 and first[0] != second[0]


def test_registration_leaves_sglangs_page_hash_loaded(node):
    """SGLang compiles its page hash (C++) on first use, in its prefetch thread at the first
    lookup: the backend has it loaded at registration, so that no lookup waits for a build."""
    from sglang.srt.mem_cache.cpp_utils import native_hash

    su.backend(su.host_pool())
    assert native_hash._load_native_hash_module.cache_info().currsize == 1


def test_a_page_hash_that_cannot_be_built_is_reported_with_its_fix_and_start_goes_on():
    import subprocess
    import sys

    code = (
        "import logging; logging.basicConfig()\n"
        "from helpers.sglang import sglang_modules; sglang_modules()\n"
        "from hpkv.integrations.sglang import warmup; print('ready', warmup.ready_page_hash(64))\n"
    )
    env = su.subprocess_env(None, TORCH_EXTENSIONS_DIR="/dev/null/extensions")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and "ready False" in out.stdout, out.stdout + out.stderr
    assert "install g++, ninja and the OpenSSL headers" in out.stderr and "TORCH_EXTENSIONS_DIR" in out.stderr
