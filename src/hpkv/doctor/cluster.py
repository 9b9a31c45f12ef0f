"""`hpkv doctor`'s checks of the cluster tier (only where HPKV_CLUSTER_ENABLE is on): the
Mooncake libraries load, the master answers, the protocol fits this machine and the address
other nodes reach this one at is not a loopback one, and this node's segment process runs.

Primitives: `check_cluster(settings, server)`.
Must not know: how checks are shown.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path

from ..cluster.client import ClusterUnavailable, advertised_host, load_store_class
from ..config import ClusterConfig, Settings
from .check import Check, ServerProbe, Verdict

RDMA_DEVICES_DIR = Path("/sys/class/infiniband")


def check_cluster(settings: Settings, server: ServerProbe) -> list[Check]:
    config = settings.cluster
    if not config.enabled:
        return []
    return [
        _check_libraries(),
        _check_master(config),
        _check_protocol(config),
        _check_host(config),
        _check_segment(config, server),
    ]


def _check_libraries() -> Check:
    try:
        load_store_class()
    except ClusterUnavailable as exc:
        missing_so = ".so" in str(exc.__cause__)  # a system library, not the package
        fix = (
            "apt-get install -y --no-install-recommends libibverbs1 libnuma1 (or your distribution's rdma-core "
            "and numactl libraries)"
            if missing_so
            else "pip install 'ct-hpkv[cluster]' into the server's environment (make setup does)"
        )
        return Check("cluster libraries", Verdict.FAIL, str(exc), fix)
    return Check("cluster libraries", Verdict.OK, "Mooncake Store's client loads")


def _check_master(config: ClusterConfig) -> Check:
    host, _, port = config.master.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=2.0).close()
    except OSError as exc:
        return Check(
            "cluster master",
            Verdict.FAIL,
            f"no mooncake_master answers at {config.master} ({exc}): the cluster tier is a miss on every lookup",
            f"start it (mooncake_master --rpc_address=<its address> --rpc_port={port}; docs/operations.md, "
            '"Many nodes with a cluster tier"), or set HPKV_CLUSTER_MASTER to where it runs',
        )
    return Check("cluster master", Verdict.OK, f"mooncake_master answers at {config.master}")


def _check_protocol(config: ClusterConfig) -> Check:
    if config.protocol == "tcp":
        return Check("cluster protocol", Verdict.OK, "tcp (HPKV_CLUSTER_PROTOCOL)")
    devices = sorted(os.listdir(RDMA_DEVICES_DIR)) if RDMA_DEVICES_DIR.is_dir() else []
    wanted = [d for d in config.rdma_devices.split(",") if d]
    missing = [d for d in wanted if d not in devices]
    if not devices or missing:
        what = f"devices {', '.join(missing)} are not" if missing else "no RDMA device is"
        return Check(
            "cluster protocol",
            Verdict.FAIL,
            f"rdma, but {what} in {RDMA_DEVICES_DIR} (this machine has: {', '.join(devices) or 'none'})",
            "set HPKV_CLUSTER_PROTOCOL=tcp, or install the NIC's RDMA driver (rdma-core) and name devices "
            "that exist in HPKV_CLUSTER_RDMA_DEVICES",
        )
    return Check("cluster protocol", Verdict.OK, f"rdma on {', '.join(wanted or devices)}")


def _check_host(config: ClusterConfig) -> Check:
    host = advertised_host(config)
    try:
        loopback = ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return Check(
            "cluster address",
            Verdict.FAIL,
            f"this node's address for the cluster, {host!r}, does not resolve",
            "set HPKV_CLUSTER_HOST to an address the other nodes reach this one at",
        )
    master_host = config.master.rpartition(":")[0].strip("[]")
    try:
        master_loopback = ipaddress.ip_address(socket.gethostbyname(master_host)).is_loopback
    except (OSError, ValueError):
        master_loopback = False
    if loopback and not master_loopback:
        return Check(
            "cluster address",
            Verdict.WARN,
            f"this node tells the cluster it is at {host}, a loopback address: other nodes cannot read the objects "
            "its segment holds (their reads fail, as misses)",
            "set HPKV_CLUSTER_HOST to this node's address on the network the nodes share",
        )
    return Check("cluster address", Verdict.OK, f"other nodes reach this node's segment at {host}")


def _check_segment(config: ClusterConfig, server: ServerProbe) -> Check:
    stats = server.stats
    if stats is None:
        return Check(
            "cluster segment",
            Verdict.INFO,
            "no server is running: it starts this node's segment process when it starts",
        )
    if stats.cluster is None:
        return Check(
            "cluster segment",
            Verdict.FAIL,
            f"the server runs without the cluster tier: {stats.cluster_unusable or 'it was started with it off'}",
            "fix what the other cluster checks say, then restart the server",
        )
    if config.segment_bytes and not stats.cluster.segment_pid:
        return Check(
            "cluster segment",
            Verdict.WARN,
            "this node's segment process is not running: the node contributes no memory to the cluster",
            "restart the server (it starts the process); its log is cluster-segment.log in the pool directory",
        )
    c = stats.cluster
    detail = f"{c.hits} hits, {c.misses} misses, {c.errors} errors, {c.bad_objects} bad objects" + (
        f", segment process {c.segment_pid}" if c.segment_pid else ", a client only (no segment)"
    )
    if not c.reachable:
        return Check(
            "cluster segment",
            Verdict.WARN,
            f"the server cannot reach the cluster now ({detail})",
            "see the cluster master check; the server tries again by itself",
        )
    return Check("cluster segment", Verdict.OK, detail)
