"""What the benchmarks share: keys and namespaces (`keys`), store and tier configurations with
the benchmarks' defaults (`configs`), a real HPKV server process (`server`), timing and verdicts
(`report`), vLLM engines with the counters a benchmark reads (`engine`), and code run inside an
engine's processes at start (`shim`, which the tests' engines use too), and two real network
file systems each mounted twice (`netfs`, the tests' two-node bed too).

Nothing here measures anything by itself; each benchmark module says what it measures.
"""
