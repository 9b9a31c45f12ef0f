"""The shared storage root's cost model and lease rules (`bench.shared_root_sim`): the invariants
the proposed design claims, checked on the model (no file system, no engine; a few seconds)."""

from __future__ import annotations

import json

import pytest

from bench import shared_root_sim as sim

COSTS = sim.DEFAULT_COSTS["glusterfs"]
TRAFFIC = sim.Traffic()


def balanced(nodes: int) -> list[int]:
    """Parts per node, as even as they go (HRW's imbalance left out: a share fixed exactly)."""
    return [sim.PARTS // nodes + (i < sim.PARTS % nodes) for i in range(nodes)]


@pytest.mark.parametrize("files_per_node", [250_000, 1_000_000])
def test_the_proposed_designs_per_node_costs_do_not_grow_with_the_files_other_nodes_own(files_per_node):
    """A fixed share per node, 4 to 256 nodes (so 64 times the files in all): the busiest node's
    memory stays, its background operations and the time it takes to count another node's write
    do not grow (its leaf directories get fewer, each fuller); today's grow with the total."""
    nodes = (4, 64, 256)
    new = [sim.proposed("glusterfs", n, n * files_per_node, COSTS, TRAFFIC, balanced(n)) for n in nodes]
    now = [sim.today("glusterfs", n, n * files_per_node, COSTS, TRAFFIC) for n in nodes]

    assert {round(r.index_mib, 6) for r in new} == {round(new[0].index_mib, 6)}
    for r in new[1:]:
        assert r.bg_ops_per_node - r.member_ops_per_node <= new[0].bg_ops_per_node - new[0].member_ops_per_node
        assert r.capacity_learns_s <= new[0].capacity_learns_s
    assert now[-1].index_mib == pytest.approx(64 * now[0].index_mib)
    assert now[-1].capacity_learns_s > 16 * now[0].capacity_learns_s  # 64x the files, the same directories
    # The one term that grows with the nodes: a renewal and a listing of N names every RENEW_S.
    for r in new:
        assert r.member_ops_per_node <= (4 + r.nodes / sim.READDIR_BATCH) / sim.RENEW_S


def test_todays_per_node_costs_grow_with_the_total_files_whatever_the_share():
    small, large = (sim.today("glusterfs", 4, files, COSTS, TRAFFIC) for files in (10_000_000, 100_000_000))

    assert large.index_mib == pytest.approx(10 * small.index_mib)
    assert large.walk_s > 8 * small.walk_s  # files x 10; leaf directories (65,536) the same
    assert large.capacity_learns_s > 8 * small.capacity_learns_s
    # More nodes on the same files: every node walks them all, so the total load grows with the nodes.
    wide = sim.today("glusterfs", 256, 100_000_000, COSTS, TRAFFIC)
    assert wide.bg_ops_total == pytest.approx(64 * large.bg_ops_total)
    assert wide.index_mib == large.index_mib


def test_the_proposed_design_walks_each_file_once_in_total_where_today_walks_it_once_per_node():
    files = 10_000_000
    for nodes in (4, 64, 256):
        now = sim.today("glusterfs", nodes, files, COSTS, TRAFFIC)
        new = sim.proposed("glusterfs", nodes, files, COSTS, TRAFFIC, balanced(nodes))

        assert (new.index_mib - sim.traffic_index_mib(TRAFFIC)) * nodes == pytest.approx(now.index_mib, rel=0.01)
        assert new.capacity_learns_s <= now.capacity_learns_s
        assert new.overshoot <= now.overshoot


def test_the_lease_rules_keep_every_part_to_one_evicting_node_and_take_a_dead_nodes_parts_over_in_bound():
    for seed in range(3):
        result = sim.simulate_protocol(seed)

        assert result.max_evictors == 1
        assert 0 < result.longest_unowned_s <= sim.TAKEOVER_BOUND_S


def test_without_the_hold_off_two_nodes_evict_one_part_at_once():
    assert sim.simulate_protocol(0, hold_s=0.0).max_evictors > 1


def test_without_the_fence_a_node_back_from_a_stall_evicts_beside_its_parts_new_owner():
    assert sim.simulate_protocol(0, fence=False).max_evictors > 1


def test_rendezvous_ownership_moves_only_the_parts_of_a_member_that_leaves():
    members = [sim.mix(i) for i in range(8)]
    before = {p: sim.hrw_owner(members, p) for p in range(512)}
    after = {p: sim.hrw_owner(members[1:], p) for p in range(512)}

    moved = {p for p in before if before[p] != after[p]}
    assert moved == {p for p in before if before[p] == members[0]}
    assert 512 / 8 / 2 < len(moved) < 512 / 8 * 2


def test_part_loads_are_seeded_and_sum_to_every_part():
    loads = sim.part_loads(64, seed=3)

    assert sum(loads) == sim.PARTS and loads == sim.part_loads(64, seed=3)
    assert max(loads) / (sim.PARTS / 64) < 1.5


def test_costs_load_from_what_bench_netfs_ops_writes(tmp_path):
    ops = {op: {"median": 100.0, "p90": 200.0, "max": 300.0, "n": 5} for op in ("create_fsync_rename", "rename")}
    ops.update({op: {"median": 10.0, "p90": 20.0, "max": 30.0, "n": 5} for op in ("stat_hit", "stat_miss")})
    ops.update(
        {
            op: {"median": 1.0, "p90": 2.0, "max": 3.0, "n": 5}
            for op in ("readdir_entry", "walk_entry", "dir_list", "unlink")
        }
    )
    ops.update({lag: {"median": 5.0, "p90": 5.0, "max": 9.0, "n": 5} for lag in ("lag_new", "lag_replace")})
    ops.update({lag: {"median": 7.0, "p90": 7.0, "max": 9.0, "n": 5} for lag in ("lag_unlink", "lag_mtime")})
    path = tmp_path / "costs.json"
    walks = [{"layout": "packed", "files": 1000, "dirs": 10, "seconds": 0.002}]
    path.write_text(json.dumps({"fs": {"somefs": ops}, "walks": {"somefs": walks}}))

    costs = sim.load_costs(path)["somefs"]

    assert costs.create == pytest.approx(100e-6) and costs.stat_miss == pytest.approx(10e-6)
    assert costs.lag_attr == pytest.approx(7e-6)
    assert "| somefs | proposed | 256 | 100 M |" in sim.markdown(sim.table_rows({"somefs": costs}, TRAFFIC, 0))
    # 1,000 files x 1 us + 10 directories x 1 us, against 2 ms measured
    assert sim.walk_checks(path) == [
        "somefs, packed: 1000 files in 10 leaf directories walked in 0.00 s, the model says 0.00 s (0.51x)"
    ]


def test_the_models_constants_are_the_implementations():
    """The cost model and the protocol simulation are of the design as built (`hpkv.storage`)."""
    from hpkv.storage import cluster, members, owner_pass, parts, reading

    timing = members.Timing()
    assert (sim.PARTS, sim.RENEW_S, sim.EXPIRE_S, sim.FRESH_S) == (
        parts.PARTS,
        timing.renew_s,
        timing.expire_s,
        timing.fresh_s,
    )
    assert (sim.HOLD_S, sim.TAKEOVER_BOUND_S, sim.MAX_LAG_S, sim.BATCH_S) == (
        timing.hold_s,
        timing.takeover_s,
        members.MAX_LAG_S,
        members.BATCH_S,
    )
    assert (sim.NEG_S, sim.NEG_ENTRIES) == (reading.MISS_S, reading.MAX_MISSES)
    assert (sim.RELIST_S, sim.MAX_FOREIGN_FILES) == (owner_pass.RELIST_S, owner_pass.MAX_FOREIGN_FILES)
    assert (sim.RESCAN_S, sim.RESCAN_COST_FACTOR) == (cluster.RESCAN_S, cluster.RESCAN_COST_FACTOR)
