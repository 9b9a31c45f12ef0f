"""The series docs/grafana/hpkv.json queries, by who exports them."""

from __future__ import annotations

import json
import re
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "hpkv.json"
_SERIES = re.compile(r"\b(hpkv_[a-z0-9_]+|vllm:[a-z0-9_:]+)")


def queried_series(prefix: str) -> set[str]:
    """Every series name starting with `prefix` ('hpkv_' or 'vllm:') in the dashboard's queries."""
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    return {name for expr in exprs for name in _SERIES.findall(expr) if name.startswith(prefix)}
