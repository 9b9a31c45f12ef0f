"""A client's mapping of a pool file lets the file's memory go once the client lets go of it:
when a server restarts, the engines' copies of the old pool must not keep its memory (a tmpfs or
ramfs file's pages are freed only when nothing has it open or mapped)."""

from __future__ import annotations

import gc
import os

import torch

from hpkv.pool.region import PoolRegion
from hpkv.transfer.blocks import PoolTensors


def holders(path) -> list[str]:
    """This process's open descriptors and mappings of `path` (deleted or not)."""
    name = str(path)
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(name):
            fds.append(f"fd {fd}")
    with open("/proc/self/maps") as f:
        maps = [line.strip() for line in f if name in line]
    return fds + maps


def test_a_client_that_lets_go_of_an_old_pool_keeps_none_of_it(shm_dir):
    server = PoolRegion.create(shm_dir, 4 << 20)
    path = server.path
    client = PoolRegion.attach(os.dup(server.share_fd()), server.size_bytes, path)
    tensors = PoolTensors(torch.device("cpu"))  # as a worker keeps it for its whole life
    pool = tensors.get(client)
    pool[:16] = 7
    assert bytes(server.view(0, 16)) == b"\x07" * 16
    server.close()  # the server is gone: its file is unlinked
    assert holders(path)  # the client still maps it
    del pool, client
    gc.collect()
    assert holders(path) == []


def test_closing_a_client_region_twice_unmaps_it_once(shm_dir):
    server = PoolRegion.create(shm_dir, 4 << 20)
    alone = holders(server.path)  # the server's own descriptor and mapping
    client = PoolRegion.attach(os.dup(server.share_fd()), server.size_bytes, server.path)
    assert len(holders(server.path)) > len(alone)
    client.close()
    client.close()
    assert holders(server.path) == alone
    server.close()
    assert holders(server.path) == []


class CountingPinning:
    """Stands in for cudaHostRegister/cudaHostUnregister: records the addresses (no CUDA here)."""

    def __init__(self) -> None:
        self.registered: list[int] = []
        self.unregistered: list[int] = []

    def register(self, address: int, nbytes: int) -> bool:
        self.registered.append(address)
        return True

    def unregister(self, address: int, nbytes: int) -> None:
        self.unregistered.append(address)


def test_a_pinning_worker_unregisters_each_old_pool_once_no_handle_refers_to_it(shm_dir, tmp_path):
    """Issue 18, row 13: a CUDA worker kept every pool generation mapped and registered for its
    life. Across real server restarts under a running worker client, each old pool is
    unregistered (before its tensor, the mapping's last hold, goes) once its handles are gone,
    and unmapped: one pool registered and mapped at the end."""
    from helpers.keys import desc, entry_key
    from helpers.server import Node
    from helpers.waiting import wait_for
    from hpkv.server.autostart import ServerUnavailable
    from hpkv.transfer.blocks import BlockCopier

    page = 4096
    layers = [torch.arange(16 * page, dtype=torch.int32).to(torch.int8).reshape(16, page) + i for i in range(2)]
    pinning = CountingPinning()
    copier = BlockCopier(layers, (0, page), pinning=pinning)
    node = Node(shm_dir, tmp_path)
    try:
        node.start_server()
        client = node.client("worker", retry_interval_s=0.01)
        ns = client.register(desc(entry_bytes=2 * page))
        for generation in range(4):
            if generation:
                node.servers[-1].terminate()
                node.servers[-1].wait(30)
                node.start_server()
                wait_for(lambda: _answers(client, ServerUnavailable), what="a reconnection")
            keys = [entry_key(f"gen{generation}", i) for i in range(2)]
            res = client.reserve(ns, keys)
            copier.save(res.region, [3, 5], res.offsets)
            assert client.commit(res) == 2
            lease = client.lease(ns, keys)
            assert client.wait(lease) == 2
            copier.load(lease.region, [7, 9], lease.offsets)
            assert copier.pools.get_pieces(lease.region)[1].wait_idle(30)  # its one piece registered
            client.release(lease)
            del res, lease
            assert all(torch.equal(v[7], v[3]) and torch.equal(v[9], v[5]) for v in layers)
        gc.collect()

        assert len(pinning.registered) == 4
        assert sorted(pinning.unregistered) == sorted(pinning.registered[:3])
        assert copier.pools.num_held() == 1
        with open("/proc/self/maps") as f:
            assert sum(str(shm_dir / "hpkv.pool") in line for line in f) == 1
    finally:
        node.close()


def _answers(client, unavailable) -> bool:
    try:
        client.stats()
        return True
    except unavailable:
        return False


class FailingOncePinning(CountingPinning):
    """A registration that raises the first time (a CUDA error surfacing as an exception)."""

    def register(self, address: int, nbytes: int) -> bool:
        if not self.registered:
            self.registered.append(0)
            raise RuntimeError("cudaHostRegister failed")
        return super().register(address, nbytes)


def test_a_registration_that_raises_leaves_the_pool_usable(shm_dir):
    server = PoolRegion.create(shm_dir, 4 << 20)
    tensors = PoolTensors(torch.device("cpu"), pinning=FailingOncePinning())
    try:
        tensor, pieces = tensors.get_pieces(server)  # the registration runs in the background
        assert pieces is not None and pieces.wait_idle(30)
        assert pieces.failed and not pieces.ready(0)  # pageable, for good
        assert tensor.numel() == server.size_bytes and tensors.num_held() == 1
    finally:
        tensors.close()
        server.close()
