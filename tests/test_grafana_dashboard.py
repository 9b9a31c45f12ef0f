"""docs/grafana/hpkv.json cannot rot: every HPKV series it queries is exported by a real `hpkv
server` (the vLLM series are checked against a real vLLM in test_vllm_optout.py)."""

from __future__ import annotations

import json

from helpers.cli import wait_for_storage, write_entries
from helpers.dashboard import DASHBOARD, queried_series
from test_metrics import scrape


def test_the_dashboard_is_grafana_json_with_a_query_in_every_panel():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["panels"] and all(panel["targets"] for panel in dashboard["panels"])
    assert len(queried_series("hpkv_")) >= 10 and len(queried_series("vllm:")) >= 5


def test_every_hpkv_series_the_dashboard_queries_is_exported_by_a_running_server(server, env):
    with server.client() as client:
        ns, keys = write_entries(client, 2)  # write-throughs, and the request latency histogram
        wait_for_storage(client, 2)
        assert client.lookup(ns, keys).num_hit == 2  # per-namespace lookups and hits
        exported = {name for name, _ in scrape(int(env["HPKV_METRICS_PORT"]))}
    assert queried_series("hpkv_") <= exported, queried_series("hpkv_") - exported
