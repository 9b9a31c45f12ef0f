"""bench.peers_report's summary of the no-reuse workload: throughput over all rounds decides
the target; the median of the rounds' own ratios shows how much one slow round moved it."""

from __future__ import annotations

import bench.peers_report as pr


def test_no_reuse_throughput_is_over_all_rounds_and_the_rounds_ratios_are_reported_beside_it():
    runs = {
        "off": [(8, 4.0), (8, 4.0), (8, 4.0)],
        "hpkv": [(8, 4.1), (8, 8.0), (8, 4.0)],  # one round twice as slow
        "lmcache": [(8, 5.0), (8, 5.0), (8, 5.0)],
    }

    out = pr.summarize_noreuse(runs)

    assert out["off"]["req_per_s"] == 24 / 12.0
    assert out["hpkv"]["rounds_req_per_s"] == [1.951, 1.0, 2.0]
    hpkv = out["hpkv / off"]
    assert round(hpkv["value"], 4) == round(12.0 / 16.1, 4) and hpkv["passed"] is False
    assert round(hpkv["median_of_rounds"], 3) == round(1.951 / 2.0, 3)
    assert out["lmcache / off"]["passed"] is None and round(out["lmcache / off"]["value"], 3) == 0.8


def test_the_cpu_of_each_systems_rounds_is_summarized_by_its_median():
    costs = {
        "off": [
            {"engine": 8.0, "hpkv_server": 0.0},
            {"engine": 9.0, "hpkv_server": 0.0},
            {"engine": 12.0, "hpkv_server": 0.01},
        ],
        "hpkv": [{"engine": 9.5, "hpkv_server": 0.15, "hpkv_saved_blocks": 384.0}],
        "lmcache": [],
    }

    out = pr.summarize_costs(costs)

    assert out == {
        "off": {"engine": 9.0, "hpkv_server": 0.0},
        "hpkv": {"engine": 9.5, "hpkv_server": 0.15, "hpkv_saved_blocks": 384.0},
    }
