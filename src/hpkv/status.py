"""Rendering of a server's stats snapshot (`hpkv.stats.ServerStats`) for `hpkv status`.

Primitives: `print_status(stats, console)`, and the small formatters `human_bytes`,
`human_duration`, `hit_rate` that other operator commands share.
Must not know: how the snapshot was fetched (the CLI asks the server).
"""

from __future__ import annotations

import json

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .fsinfo import mount_of
from .stats import DramStats, ServerStats, StorageClusterStats, StorageStats
from .units import human_bytes, short_duration

NS_PREFIX_CHARS = 12
STATUS_NAMESPACES = 50  # the table shows this many namespaces, the most looked up (`--json`: all)
MEMBERS_SHOWN = 8  # live members named in the storage cluster's table (`--json`: all)


def human_duration(seconds: float) -> str:
    seconds = int(seconds)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, seconds = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h {minutes}m"
    if hours:
        return f"{hours}h {minutes}m"
    if minutes:
        return f"{minutes}m {seconds}s"
    return f"{seconds}s"


def hit_rate(hit_keys: int, lookup_keys: int) -> str:
    return f"{100.0 * hit_keys / lookup_keys:.1f}%" if lookup_keys else "-"


def print_status(stats: ServerStats, console: Console) -> None:
    console.print(_tiers_table(stats))
    if stats.storage is not None and stats.storage.cluster is not None:
        console.print(_storage_cluster_table(stats.storage, stats.storage.cluster))
    console.print(_namespaces_table(stats))
    summary = stats.namespace_summary
    if summary.total > len(stats.namespaces) or summary.refused:
        console.print(Text(_namespace_line(stats)))
    console.print(_clients_table(stats))
    console.print(_server_table(stats))


def _used(tier: DramStats | StorageStats) -> str:
    capacity = tier.capacity_bytes
    share = f" ({100.0 * tier.used_bytes / capacity:.1f}%)" if capacity else ""
    return human_bytes(tier.used_bytes) + share


def _pool_state(stats: ServerStats) -> str:
    dram = stats.dram
    if dram.ready_bytes < dram.capacity_bytes and dram.locked_bytes >= dram.ready_bytes:
        return f"reserving pages: {human_bytes(dram.ready_bytes)} ready"
    if dram.no_lock_why:
        return f"never swapped ({dram.no_lock_why})"
    if dram.locked_in_memory:
        return "locked in memory"
    try:
        on_ramfs = mount_of(stats.server.pool_path).fs_type == "ramfs"
    except OSError:
        on_ramfs = False
    return "on ramfs (never swapped)" if on_ramfs else "NOT locked in memory (may be swapped)"


def _tiers_table(stats: ServerStats) -> Table:
    table = Table(title="tiers", title_justify="left")
    for column in ("tier", "path", "capacity", "used", "entries", "evictions", "state"):
        table.add_column(column, no_wrap=True)
    dram = stats.dram
    table.add_row(
        "DRAM",
        Text(stats.server.pool_path),
        human_bytes(dram.capacity_bytes),
        _used(dram),
        str(dram.num_entries),
        str(dram.evictions),
        _pool_state(stats),
    )
    cluster = _cluster_row(stats)
    if cluster is not None:
        table.add_row(*cluster)
    storage = stats.storage
    path = Text(stats.server.storage_path)
    if storage is None and stats.storage_unusable:
        table.add_row(
            "storage",
            path,
            "-",
            "-",
            "-",
            "-",
            Text(
                f"UNUSABLE, the server runs with the DRAM tier only: {stats.storage_unusable}; then restart the server",
                style="bold red",
            ),
        )
    elif storage is None:
        table.add_row("storage", path, "-", "-", "-", "-", "disabled (HPKV_KV_STORAGE_ENABLE)")
    else:
        table.add_row(
            "storage",
            path,
            human_bytes(storage.capacity_bytes),
            _used(storage),
            str(storage.num_entries),
            str(storage.evictions),
            _storage_state(stats, storage),
        )
    return table


def _cluster_row(stats: ServerStats) -> tuple[str | Text, ...] | None:
    """The cluster tier's row (None where it is off): its master, this node's share, what this
    node wrote (objects, bytes) and how its reads went."""
    c = stats.cluster
    if c is None and stats.cluster_unusable:
        why = f"UNUSABLE, the server runs without it: {stats.cluster_unusable}; then restart the server"
        return ("cluster", "-", "-", "-", "-", "-", Text(why, style="bold red"))
    if c is None:
        return None
    state = "reachable" if c.reachable else "UNREACHABLE (lookups miss it; it is tried again by itself)"
    state += f" over {c.protocol}, {c.hits} hits, {c.misses} misses, {c.errors} errors"
    if c.bad_objects:
        state += f", {c.bad_objects} bad objects removed"
    if c.timeouts:
        state += f", {c.timeouts} lookups timed out"
    if c.write_dropped:
        state += f", {c.write_dropped} entries not written (queue full)"
    if c.segment_bytes:
        state += f", segment process {c.segment_pid}" if c.segment_pid else ", segment process NOT RUNNING"
    written = f"{human_bytes(c.bytes_written)} written"
    return ("cluster", Text(c.master), human_bytes(c.segment_bytes), written, str(c.objects_written), "-", state)


def _storage_cluster_table(storage: StorageStats, c: StorageClusterStats) -> Table:
    """The storage root shared as a cluster (HPKV_KV_STORAGE_CLUSTER): this node's member, the
    members it sees, its parts, its usage against its share of the capacity, its last pass."""
    table = Table(title="storage cluster (this node's view)", title_justify="left", show_header=False)
    table.add_column("what", no_wrap=True)
    table.add_column("value")
    renewed = "never renewed" if c.last_renew_age_s is None else f"renewed {human_duration(c.last_renew_age_s)} ago"
    shown = ", ".join(c.live_members[:MEMBERS_SHOWN])
    more = f" and {len(c.live_members) - MEMBERS_SHOWN} more" if len(c.live_members) > MEMBERS_SHOWN else ""
    parts = f"{c.parts_owned} of {c.parts} ({100.0 * c.parts_owned / c.parts:.1f}%), {c.parts_evictable} evictable"
    if c.fenced:
        parts += ", FENCED: it evicts nothing until it renews its lease and lists the members again"
    share = 100.0 * c.owned_bytes / c.capacity_share_bytes if c.capacity_share_bytes else 0.0
    rows = (
        (
            "member",
            f"{c.member}, lease {c.lease_s:g} s, {renewed} ({c.renewals} renewals, {c.renew_failures} failed, "
            f"{c.lease_remade} made again after a stall)",
        ),
        (
            "live members",
            f"{len(c.live_members)}: {shown}{more}; {c.members_expired} seen expire, {c.members_back} back "
            f"after a stall, {c.leases_reaped} leases reaped; {c.listings} listings, {c.list_failures} failed",
        ),
        ("parts owned", parts),
        (
            "usage",
            f"{human_bytes(c.owned_bytes)} in {c.owned_files} files in its parts, {share:.1f}% of its share "
            f"{human_bytes(c.capacity_share_bytes)} of the root's {human_bytes(storage.capacity_bytes)}; "
            f"{c.foreign_files} files of others' parts indexed (what it wrote or read lately)",
        ),
        ("last pass", _last_pass(c)),
    )
    for what, value in rows:
        table.add_row(what, Text(value))
    return table


def _last_pass(c: StorageClusterStats) -> str:
    runs = f"{c.passes} passes, {c.pass_failures} failed"
    if c.last_pass_age_s is None or c.last_pass_s is None:
        return f"none yet ({runs})"
    return (
        f"{human_duration(c.last_pass_age_s)} ago, took {c.last_pass_s:.1f} s: {c.last_pass_dirs_statted} leaf "
        f"directories looked at, {c.last_pass_dirs_listed} listed, {c.last_pass_files_statted} names looked "
        f"up, {c.last_pass_added} files indexed, {c.last_pass_gone} found removed by others ({runs})"
    )


def _storage_state(stats: ServerStats, storage: StorageStats) -> str:
    index = "index ready" if storage.index_ready else f"index building ({storage.files_scanned} files)"
    state = f"{index}, {storage.bad_files} bad files, {storage.write_failures} write failures, "
    writers = stats.writers
    if not writers:
        state += "written by the server process"
    elif not writers.processes and writers.unavailable:
        state += f"written by the server process ({writers.unavailable})"
    else:
        state += f"{writers.processes} write-through processes (nice {writers.nice})"
    if storage.direct_io:
        state += ", direct I/O"
    if storage.untrusted_files:
        state += (
            f", {storage.untrusted_files} names skipped that are not regular files (links, FIFOs...: "
            "never hits; see hpkv doctor)"
        )
    if storage.write_budget_bytes is not None:
        state += (
            f", write budget {human_bytes(storage.write_budget_bytes)} a day "
            f"({human_bytes(storage.write_budget_available_bytes or 0)} left now, "
            f"{storage.over_budget} writes over it)"
        )
    if storage.stale_entries:
        state += f", {storage.stale_entries} indexed files found gone (removed by another server or node)"
    if storage.root_replaced:
        state += f", REPLACED: {storage.root_replaced}"
    if storage.retention_s is not None:
        state += f", retention {short_duration(storage.retention_s)} ({storage.expired} files expired)"
    backlog = stats.write_backlog
    if backlog is not None and backlog.entries:
        state += f", {backlog.entries} entries ({human_bytes(backlog.bytes)}) waiting to be written"
        if backlog.deferred:
            state += f" and {backlog.deferred} more deferred (the backlog holds half the pool)"
    lost = stats.store.write_through_lost
    if lost:
        state += f", {lost} entries never written (evicted before their turn, or given up at a stop)"
    return state


def _namespaces_table(stats: ServerStats) -> Table:
    store = stats.store
    table = Table(title="namespaces", title_justify="left")
    for column in (
        "namespace",
        "engine",
        "model",
        "model from",
        "dtype",
        "tp/rank",
        "entry",
        "lookups",
        "keys",
        "DRAM hits",
        "storage hits",
        "all hits",
    ):
        table.add_column(column, no_wrap=column not in ("model", "model from"))
    for ns, entry in sorted(stats.namespaces.items()):
        desc = _desc(entry.desc)
        keys = entry.lookup_keys
        table.add_row(
            ns[:NS_PREFIX_CHARS],
            Text(str(desc.get("engine", "?"))),
            Text(str(desc.get("model", "?"))),
            Text(_model_source(desc)),
            Text(str(desc.get("dtype", "?"))),
            f"{desc.get('tp_size', '?')}/{desc.get('rank', '?')}",
            human_bytes(desc["entry_bytes"]) if "entry_bytes" in desc else "?",
            str(entry.lookups),
            str(keys),
            hit_rate(entry.hit_keys_dram, keys),
            hit_rate(entry.hit_keys_storage, keys),
            hit_rate(entry.hit_keys_dram + entry.hit_keys_storage, keys),
        )
    keys = store.lookup_keys
    table.add_row(
        "all",
        "",
        "",
        "",
        "",
        "",
        "",
        str(store.lookups),
        str(keys),
        hit_rate(store.hit_keys_dram, keys),
        hit_rate(store.hit_keys_storage, keys),
        hit_rate(store.hit_keys_dram + store.hit_keys_storage, keys),
        style="bold",
    )
    return table


def _namespace_line(stats: ServerStats) -> str:
    summary = stats.namespace_summary
    line = f"{summary.total} namespaces ({summary.held} registered by clients connected now)"
    if summary.total > len(stats.namespaces):
        line += f"; the {len(stats.namespaces)} most looked up shown (`hpkv status --json` lists all)"
    if summary.refused:
        line += (
            f"; {summary.refused} registrations refused at a limit (HPKV_SERVER_MAX_NAMESPACES="
            f"{summary.max_total}, HPKV_SERVER_MAX_NAMESPACES_PER_UID={summary.max_per_uid}, "
            f"HPKV_SERVER_MAX_NAMESPACE_BYTES={summary.max_desc_bytes})"
        )
    return line


def _model_source(desc: dict) -> str:
    """What the namespace's model identity was derived from (the engines put it in `extra`)."""
    extra = desc.get("extra")
    source = extra.get("model_source") if isinstance(extra, dict) else None
    return str(source) if source else "-"


def _desc(text: str) -> dict:
    try:
        desc = json.loads(text)
    except ValueError:
        return {}
    return desc if isinstance(desc, dict) else {}


def _clients_table(stats: ServerStats) -> Table:
    table = Table(title="clients", title_justify="left")
    for column in ("id", "kind", "pid", "uid", "connected for", "leases"):
        table.add_column(column, no_wrap=True)
    for client in sorted(stats.clients, key=lambda c: c.id):
        table.add_row(
            str(client.id),
            Text(client.kind),
            str(client.pid),
            str(client.uid),
            human_duration(client.connected_s),
            str(client.leases),
        )
    return table


def _server_table(stats: ServerStats) -> Table:
    server = stats.server
    mode = (
        "auto-started (exits when its last client leaves)"
        if server.auto
        else "managed (hpkv server; stays up across engine restarts)"
    )
    table = Table(title="server", title_justify="left", show_header=False)
    table.add_column("what", no_wrap=True)
    table.add_column("value")
    rows = (
        ("pid", str(server.pid)),
        ("version", f"{server.version} (protocol {server.protocol})"),
        ("uptime", human_duration(server.uptime_s)),
        ("mode", mode),
        ("socket", server.socket),
        ("held now", f"{stats.leases} leases, {stats.reservations} reservations" + _holds(stats)),
        *_limits(stats),
    )
    for what, value in rows:
        table.add_row(what, Text(value))
    return table


def _limits(stats: ServerStats) -> tuple[tuple[str, str], ...]:
    """A row once a client has met the limits on what it may hold (HPKV_SERVER_SLOT_TIMEOUT_S,
    HPKV_SERVER_MAX_SLOT_SHARE, HPKV_SERVER_MAX_USER_SLOT_SHARE)."""
    limits = stats.limits
    expired = limits.expired_reservations + limits.expired_leases
    if not expired and not limits.capped_keys:
        return ()
    return (
        (
            "held too long or too much",
            f"{limits.expired_reservations} reservations and "
            f"{limits.expired_leases} leases taken back at the time limit, {limits.capped_keys} keys asked for "
            "past a process's or a user's share of the pool (misses)",
        ),
    )


def _holds(stats: ServerStats) -> str:
    num = stats.holds
    return f" ({num} holds waiting for an engine's scheduler to settle them)" if num else ""
