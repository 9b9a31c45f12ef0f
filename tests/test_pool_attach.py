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
