"""HPKV's storage tier against LMCache's fs L2 adapter (`lmcache bench l2`), beside the disk limit.

    python bench/storage_peers.py [--sizes 64k,256k,1m,4m] [--rounds 5] [--in-flight 8]
                                  [--storage-dir DIR] [--cold] [--json]

See `hpkv.benchmark.storage_peers` for what is measured and how both sides are kept alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from hpkv.benchmark.dataplane import human_bytes
from hpkv.benchmark.storage_peers import PeerConfig, PeerReport, PeerRow, run
from hpkv.config import parse_size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64k,256k,1m,4m", help="entry sizes, comma-separated")
    parser.add_argument("--round", default="256m", help="bytes moved per round and entry size")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (after one warm-up); the best counts")
    parser.add_argument("--in-flight", type=int, default=8,
                        help="LMCache's --in-flight and HPKV's I/O threads (HPKV_IO_THREADS)")
    parser.add_argument("--storage-dir", type=Path, default=None,
                        help="parent of the temporaries of both sides (default: the current directory)")
    parser.add_argument("--cold", action="store_true",
                        help="sync and drop the page cache between writes and reads (root only)")
    parser.add_argument("--lmcache", default=None, help="the lmcache command (default: beside this python)")
    parser.add_argument("--json", action="store_true", help="JSON on stdout")
    parser.add_argument("--table-from", type=Path, default=None, metavar="JSON",
                        help="print the table of a run saved with --json, and measure nothing")
    args = parser.parse_args(argv)
    if args.table_from:
        print_table(from_json(args.table_from.read_text()), Console(width=160))
        return 0
    extra = {"lmcache": args.lmcache} if args.lmcache else {}
    config = PeerConfig(entry_sizes=tuple(parse_size(s) for s in args.sizes.split(",")),
                        round_bytes=parse_size(args.round), rounds=args.rounds, in_flight=args.in_flight,
                        storage_parent=args.storage_dir, cold=args.cold, **extra)
    err = Console(stderr=True)
    report = run(config, lambda message: err.print(f"measuring {message}..."))
    if args.json:
        print(to_json(report))
    else:
        print_table(report, Console(width=160))
    return 0


def to_json(report: PeerReport) -> str:
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(report.config).items()}
    rows = [{**dataclasses.asdict(row), "vs_peer": row.vs_peer, "vs_limit": row.vs_limit,
             "target": row.target, "passed": row.passed} for row in report.rows]
    return json.dumps({"config": config, "machine": report.machine, "rows": rows,
                       "elapsed_s": round(report.elapsed_s, 1), "file_costs": report.file_costs}, indent=2)


def from_json(text: str) -> PeerReport:
    doc = json.loads(text)
    fields = {f.name for f in dataclasses.fields(PeerRow)}
    config = {**doc["config"], "entry_sizes": tuple(doc["config"]["entry_sizes"])}
    if config["storage_parent"] is not None:
        config["storage_parent"] = Path(config["storage_parent"])
    rows = tuple(PeerRow(**{k: v for k, v in row.items() if k in fields}) for row in doc["rows"])
    return PeerReport(PeerConfig(**config), doc["machine"], rows, doc["elapsed_s"], doc.get("file_costs", {}))


def print_table(report: PeerReport, console: Console) -> None:
    m = report.machine
    table = Table(title=Text(f"HPKV storage tier vs LMCache fs adapter ({m['cpus']} CPUs, "
                             f"load {m['load_avg_1m']})"))
    for name in ("entry", "op", "HPKV", "LMCache fs", "disk limit", "HPKV/LMCache", "HPKV/limit",
                 "target", "result"):
        table.add_column(name, justify="left" if name in ("op", "target", "result") else "right",
                         no_wrap=True)
    for row in report.rows:
        result = Text("PASS", style="green") if row.passed else Text("MISS", style="bold red")
        table.add_row(human_bytes(row.entry_bytes), row.direction, f"{row.hpkv:.2f} GB/s",
                      f"{row.lmcache:.2f} GB/s", f"{row.limit:.2f} GB/s", f"{row.vs_peer:.2f}x",
                      f"{row.vs_limit:.2f}x", row.target, result)
    console.print(table)
    c = report.config
    storage = m["storage_dir"]
    console.print(Text(
        f"both on {storage['fs_type']} ({storage['path']}); page cache: "
        f"{'dropped between writes and reads' if c.cold else 'reads right after writes'}; fsync off, "
        f"no O_DIRECT on both sides; {c.in_flight} in flight; {human_bytes(c.round_bytes)} per round, "
        f"new keys each round; best of {c.rounds} rounds after 1 warm-up; GB/s = 10^9 bytes/s; "
        f"{report.elapsed_s:.0f} s in all"))
    f = report.file_costs
    if f:
        console.print(Text(
            f"per file on this file system (one thread, {f['files']} empty files): create {f['create_us']:.0f} us "
            f"({f['create_system_us']:.0f} us of system CPU), unlink {f['unlink_us']:.0f} us "
            f"({f['unlink_system_us']:.0f} us); every entry written pays one create, the limit's one file does not"))


if __name__ == "__main__":
    sys.exit(main())
