"""The vLLM worker half's asynchronous saves against a real HPKV server and real CPU tensors:
the saver thread copies and commits after `wait_for_save` has returned, and `fence` holds back
a step that would overwrite a block whose save is still reading it, and only such a step."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from helpers.keys import desc, entry_key
from helpers.server import Node
from helpers.waiting import wait_for
from hpkv.server import protocol

pytestmark = pytest.mark.vllm

LAYERS, PAGE, NUM_BLOCKS = 2, 8 << 10, 16
ENTRY = LAYERS * PAGE


@pytest.fixture
def worker(shm_dir, tmp_path):
    from hpkv.integrations.vllm.connectorstats import HpkvConnectorStats
    from hpkv.integrations.vllm.savequeue import SaveQueue
    from hpkv.integrations.vllm.worker import HpkvWorker
    from hpkv.server.client import Client
    from hpkv.transfer.blocks import BlockCopier

    node = Node(shm_dir, tmp_path)
    node.start_server()
    # The worker as register_kv_caches leaves it, without a vLLM config: real client, real copier.
    w = HpkvWorker.__new__(HpkvWorker)
    w.rank, w.async_saves = 0, True
    w.layout = SimpleNamespace(entry_bytes=ENTRY)
    w.desc = desc(0, ENTRY)
    w.client = Client(shm_dir, kind="vllm-worker-0", autostart=False)
    w.stats, w._failed_blocks, w._failed_holds, w._meta_out = HpkvConnectorStats(), set(), set(), None
    w._stats_lock, w._side_stream = threading.Lock(), None
    w.saves = SaveQueue(w._save)
    w._releaser = None
    w.layers = [torch.randint(-128, 128, (NUM_BLOCKS, PAGE), dtype=torch.int8) for _ in range(LAYERS)]
    w.copier = BlockCopier(w.layers, (0, PAGE))
    w.ns = w.client.register(w.desc)
    # One KV cache group; w.desc, w.ns and w.copier name its namespace and copier for the tests.
    w.layouts, w.descs, w.nss, w.copiers, w._recving = [w.layout], [w.desc], [w.ns], [w.copier], (set(), set())
    try:
        yield w, node
    finally:
        w.shutdown()
        node.close()


def _meta(keys, block_ids):
    from hpkv.integrations.vllm.metadata import HpkvConnectorMetadata, SaveJob

    return HpkvConnectorMetadata(saves=[SaveJob("req", keys, block_ids)])


def _entry(w, block: int) -> bytes:
    return b"".join(layer[block].numpy().tobytes() for layer in w.layers)


def test_saves_land_after_wait_for_save_returns_and_a_fence_waits_only_for_blocks_in_flight(worker):
    w, node = worker
    gate = threading.Event()
    copy = w.copier.save
    w.copier.save = lambda *args: (gate.wait(10), copy(*args))  # the copy takes until the gate opens

    keys = [entry_key("async", i) for i in range(4)]
    blocks = [3, 4, 5, 9]
    expected = [_entry(w, b) for b in blocks]
    w.wait_for_save(_meta(keys, blocks))  # returns with the copy still to do
    reader = node.client("reader")
    reader.register(w.desc)
    assert reader.lookup(w.ns, keys).num_hit == 0  # reserved, not yet published

    started = time.monotonic()
    w.fence([0, 1, 2, 10])  # blocks no save reads: no wait
    assert time.monotonic() - started < 0.5

    fenced = threading.Event()
    threading.Thread(target=lambda: (w.fence([7, 9]), fenced.set()), daemon=True).start()
    time.sleep(0.3)
    assert not fenced.is_set()  # block 9 is still being saved
    gate.set()
    assert fenced.wait(10)

    wait_for(lambda: reader.lookup(w.ns, keys).num_hit == 4, what="the saves published")
    lease = reader.lease(w.ns, keys)
    assert reader.wait(lease) == 4
    assert [bytes(lease.view(i)) for i in range(4)] == expected
    reader.release(lease)
    stats = w.take_stats().data
    assert stats["saved_blocks"] == 4 and stats["save_fences"] == 1


def test_a_save_whose_connection_was_lost_copies_nothing_into_the_slots(worker):
    w, node = worker
    gate = threading.Event()
    original_alive = w.client.alive
    w.client.alive = lambda handle: (gate.wait(10), original_alive(handle))[1]

    reserved = []
    original_reserve = w.client.reserve_many
    w.client.reserve_many = lambda *args, **kw: reserved.append(original_reserve(*args, **kw)) or reserved[-1]

    keys = [entry_key("lost", i) for i in range(2)]
    w.wait_for_save(_meta(keys, [1, 2]))
    w.client._drop("a call timed out")  # the reservation's connection is gone before the copy
    gate.set()
    w.fence([1, 2])
    (reservation,) = reserved
    for offset in reservation.offsets:  # the server may hand these slots to another writer
        assert bytes(reservation.region.buf[offset : offset + ENTRY]) == bytes(ENTRY)
    reader = node.client("reader")
    assert reader.lookup(w.ns, keys).num_hit == 0
    stats = w.take_stats()
    assert stats.data["saved_blocks"] == 0 and stats.data["save_wait_s"] > 0


def test_a_load_copies_before_the_forward_pass_and_its_lease_is_released_after(worker):
    """start_load_kv returns with the bytes in place; the release's round trip happens on the
    release thread, and the server drops the lease once it arrives."""
    from hpkv.integrations.vllm.metadata import HpkvConnectorMetadata, LoadJob

    w, node = worker
    w.async_saves = False
    keys = [entry_key("load", i) for i in range(3)]
    saved = [_entry(w, b) for b in (1, 2, 3)]
    w.wait_for_save(_meta(keys, [1, 2, 3]))
    gate = threading.Event()
    release = w.client.release
    w.client.release = lambda lease: (gate.wait(10), release(lease))  # the reply takes until the gate opens

    w.start_load_kv(HpkvConnectorMetadata(loads=[LoadJob("req", keys, [12, 13, 14])]))

    assert [_entry(w, b) for b in (12, 13, 14)] == saved
    assert w.take_failed_blocks() == set()
    assert w.client.stats().leases == 1  # still held: its release has not gone out yet
    gate.set()
    assert wait_for(lambda: w.client.stats().leases == 0)


def test_a_held_save_is_copied_in_its_step_and_published_only_when_its_hold_is_settled(worker):
    """Saves of a step after a load are reserved in the step's hold: copied before wait_for_save
    returns (even with asynchronous saves), committed by nobody but the scheduler's settle."""
    from hpkv.integrations.vllm.metadata import HpkvConnectorMetadata, SaveJob

    w, node = worker
    keys = [entry_key("held", i) for i in range(3)]
    blocks = [4, 6, 8]
    expected = [_entry(w, b) for b in blocks]
    w.wait_for_save(HpkvConnectorMetadata(saves=[SaveJob("req", keys, blocks)], seq=7, hold="engine.7"))
    assert w.saves.idle  # nothing left for the saver thread
    reader = node.client("reader")
    reader.register(w.desc)
    time.sleep(0.2)
    assert reader.lookup(w.ns, keys).num_hit == 0

    settler = node.client("vllm-scheduler")
    assert settler.settle("engine.7", [keys[2]]) == protocol.Settled(2, 1)

    assert reader.lookup(w.ns, keys).num_hit == 2
    lease = reader.lease(w.ns, keys[:2])
    assert reader.wait(lease) == 2
    assert [bytes(lease.view(i)) for i in range(2)] == expected[:2]
    reader.release(lease)


def test_a_held_save_whose_copy_fails_gives_its_slots_back_before_the_settle(worker):
    from hpkv.integrations.vllm.metadata import HpkvConnectorMetadata, SaveJob

    w, node = worker
    keys = [entry_key("torn", i) for i in range(2)]

    def torn_copy(*args):
        raise RuntimeError("the device went away mid-copy")

    w.copier.save = torn_copy
    w.wait_for_save(HpkvConnectorMetadata(saves=[SaveJob("req", keys, [1, 2])], seq=9, hold="engine.9"))

    assert w.worker_meta(10).failed == {9}  # told to the scheduler, which aborts the hold on every rank
    settler = node.client("vllm-scheduler")
    assert settler.settle("engine.9", []) == protocol.Settled(0, 0)
    reader = node.client("reader")
    reader.register(w.desc)
    assert reader.lookup(w.ns, keys).num_hit == 0
    assert w.client.stats().reservations == 0


def test_a_held_save_that_fails_after_its_step_reported_still_reaches_the_scheduler(worker):
    """With speculative decoding vLLM builds the step's worker metadata before the saves run:
    a failure then must land in that same metadata, not in a later step's."""
    from hpkv.integrations.vllm.metadata import HpkvConnectorMetadata, SaveJob

    w, node = worker
    meta = w.worker_meta(11)
    w.copier.save = lambda *args: (_ for _ in ()).throw(RuntimeError("torn"))
    w.wait_for_save(
        HpkvConnectorMetadata(saves=[SaveJob("req", [entry_key("late", 0)], [3])], seq=11, hold="engine.11")
    )
    assert meta.failed == {11}
    assert w.worker_meta(12).failed == set()
