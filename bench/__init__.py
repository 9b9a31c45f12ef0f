"""HPKV's benchmarks, one module per benchmark, each run from the repository root as
`python -m bench.<name> [--help]`.

The rule between here and `hpkv.benchmark`: the package ships only what `hpkv bench` runs (the
data-plane benchmark); every other benchmark, and what only benchmarks use (the LMCache peer, the
multi-round workload), lives here. What several benchmarks share lives in `bench.harness`; a
benchmark imports another only for that one's own figures (`peers` -> `peers_report`).
"""
