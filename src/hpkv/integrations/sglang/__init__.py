"""SGLang: `--enable-ct-hpkv` and HPKV as the L3 storage backend of SGLang's hierarchical cache.

- `flag`: rewrites `--enable-ct-hpkv` into SGLang's own HiCache flags (SGLang is imported only to
  expand a `--config` file).
- `plugin`: the two entry points SGLang discovers: a `sglang.serve_backends` backend whose
  detector claims `sglang serve ... --enable-ct-hpkv`, and a `sglang.srt.plugins` hook that
  rewrites the flag before `prepare_server_args` (so `python -m sglang.launch_server` works too).
- `layout`: what one HPKV entry is for SGLang (one host-pool page) and its namespace.
- `pages`: byte copies between host-pool pages and pool entries.
- `backend`: `HpkvStorage`, the `HiCacheStorage` subclass SGLang's `dynamic` backend builds;
  `stats` its counters.
"""
