"""A benchmark report as a rich table (for people) or a JSON document (for tools)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from rich.console import Console, JustifyMethod
from rich.table import Table
from rich.text import Text

from .dataplane import Report, Row, human_bytes
from .lookup import PREFIX_KEYS
from .machine import Machine


def to_json(report: Report) -> str:
    config = {
        name: (str(value) if isinstance(value, Path) else value)
        for name, value in dataclasses.asdict(report.config).items()
    }
    rows = [{**dataclasses.asdict(row), "ratio": row.ratio} for row in report.rows]
    return json.dumps(
        {"config": config, "machine": report.machine, "rows": rows, "elapsed_s": round(report.elapsed_s, 2)}, indent=2
    )


def print_table(report: Report, console: Console) -> None:
    table = Table(title=Text(f"HPKV data plane ({_machine_line(report.machine)})"))
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("measure", "left"),
        ("entry", "right"),
        ("HPKV", "right"),
        ("limit", "right"),
        ("ratio", "right"),
        ("target", "left"),
        ("result", "left"),
    )
    for name, justify in columns:
        table.add_column(name, justify=justify, no_wrap=True)
    for row in report.rows:
        table.add_row(*_cells(row))
    console.print(table)
    for row in report.rows:
        if row.detail:
            console.print(Text(f"{row.measure}: {row.detail}"))
    pool, storage = report.machine["pool_dir"], report.machine["storage_dir"]
    console.print(
        Text(
            f"pool on {pool['fs_type']} ({pool['path']}), storage on "
            f"{storage['fs_type']} ({storage['path']}); GB/s = 10^9 bytes/s, "
            f"throughputs: best of {report.config.reps} rounds; {report.elapsed_s:.0f} s in all"
        )
    )


def _cells(row: Row) -> list[Text]:
    if row.unit == "GB/s":
        entry, value = human_bytes(row.entry_bytes), f"{row.value:.2f} GB/s"
        limit, ratio = f"{row.limit:.2f} GB/s", f"{row.ratio:.2f}x"
    else:
        entry, value = f"{PREFIX_KEYS:,} keys", f"{row.value:.3f} ms (p99 {row.p99:.3f})"
        limit, ratio = f"{row.limit:.3f} ms (dict)", ""
    result = {None: Text(""), True: Text("PASS", style="green"), False: Text("MISS", style="bold red")}[row.passed]
    return [Text(row.measure), Text(entry), Text(value), Text(limit), Text(ratio), Text(row.target), result]


def _machine_line(machine: Machine) -> str:
    return f"{machine['cpus']} CPUs, {machine['memory_bytes'] / 2**30:.0f} GiB, load {machine['load_avg_1m']}"
