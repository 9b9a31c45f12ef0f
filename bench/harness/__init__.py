"""What the benchmarks share: keys and namespaces (`keys`), store and tier configurations with
the benchmarks' defaults (`configs`), a real HPKV server process (`server`), timing and verdicts
(`report`), and vLLM engines with the counters a benchmark reads (`engine`).

Nothing here measures anything by itself; each benchmark module says what it measures.
"""
