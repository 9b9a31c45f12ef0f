"""Helpers the tests share, one concept a module; the tests import them as `helpers.<module>`
(pyproject's pytest `pythonpath` puts tests/ on sys.path, for one file and for the whole suite).

- `waiting`: `wait_for`, polling a condition with a deadline.
- `processes`: whether a pid is alive, waiting for it to go, killing and stopping it.
- `env`: which variables configure HPKV, environments without them, PYTHONPATH for children.
- `keys`: deterministic keys, payloads and namespace descriptions.
- `config`: pool and storage configs on test directories.
- `users`: running a function as another uid.
- `server`: a node (directories, environment, servers) and client processes driven by commands.
- `agent`: the client process side of `server.Agent` (run as `python -m helpers.agent`).
- `cli`: `hpkv` commands against an `hpkv server` child process.
- `storage`: KV files on a storage directory.
- `machine`: a pretend machine (meminfo, mounts, cgroups) for `hpkv.fsinfo`.
- `mappings`: this process's mappings of pool files, and a region's resident bytes.
- `scheduler`: the vLLM scheduler half built by hand on a real server, no engine.
- `engines`: the engine tests as a whole: the vLLM skip, the tally of engine starts.
- `vllm`: real vLLM engines with their counters, and the oracle.
- `sglang`: real SGLang modules, host pools and arguments on a CPU-only machine.
"""
