"""Benchmarks of HPKV's data plane against the limits of the machine it runs on.

`dataplane.run(BenchConfig)` measures, in one run, DRAM copies through the store, storage reads
and writes through the tier, and prefix lookups in a large index, each beside the plain-OS or
plain-numpy figure for the same bytes; `report` prints the result as a table or JSON.
`hpkv bench` is the command line for it. Targets are shown, never enforced: a benchmark reports.
"""

from .dataplane import BenchConfig, Report, Row, run

__all__ = ["BenchConfig", "Report", "Row", "run"]
