"""`--enable-ct-hpkv`: the one flag the product documents for SGLang, rewritten into SGLang's own.

    sglang serve --model-path MODEL --enable-ct-hpkv --page-size 64 ...
becomes
    sglang serve --model-path MODEL --page-size 64 ... --enable-hierarchical-cache
        --hicache-storage-backend dynamic --hicache-mem-layout page_first
        --hicache-storage-backend-extra-config '{"backend_name": "ct_hpkv",
            "module_path": "hpkv.integrations.sglang.backend", "class_name": "HpkvStorage",
            "interface_v1": 1, "prefetch_threshold": <VLLM_HPKV_TOKEN_THRESHOLD>}'

Rules:
- Idempotent (both entry points may run on one command line); no flag, argv unchanged.
- A HiCache flag the user gave (on the command line or in `--config`) is never overridden; an
  inline JSON extra-config keeps its keys and gains only those it lacks; a `@file` extra-config or
  another storage backend is left as it is, with a warning. Flags given as unique prefixes are
  spelled out first, as argparse resolves them, so they count as given.
- `--hicache-mem-layout page_first` pins the layout (part of HPKV's namespaces) across SGLang
  upgrades; on Ascend, or with `--hicache-io-backend`, the layout is SGLang's to choose.
- `--device cpu`: SGLang's `kernel` io backend has no CPU build (the `page_first` layout needs
  it), so `--hicache-io-backend direct` unless an io backend was given, and the layout
  `page_first_direct` (the same two regions per page for HPKV) unless a layout or io backend was.
- `--model-path --enable-ct-hpkv /path/to/model` works: dropping the flag leaves the path.

Primitives: `FLAG`, `wants_hpkv(argv)`, `rewrite_argv(argv, threshold)`, `token_threshold()`.
Must not know: pools, servers; it imports SGLang only for its parser (`--config`, flag names).
"""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Sequence

log = logging.getLogger("hpkv.sglang")

FLAG = "--enable-ct-hpkv"
BACKEND_NAME = "ct_hpkv"
BACKEND_MODULE = "hpkv.integrations.sglang.backend"
BACKEND_CLASS = "HpkvStorage"
DOCUMENTED_THRESHOLD = 1204  # VLLM_HPKV_TOKEN_THRESHOLD's documented default, also used for "auto"

_HICACHE_ON = ("--enable-hierarchical-cache", "--enable-hicache")
_BACKEND = "--hicache-storage-backend"
_EXTRA = "--hicache-storage-backend-extra-config"
_LAYOUT = "--hicache-mem-layout"
_IO = "--hicache-io-backend"


def wants_hpkv(argv: Sequence[str]) -> bool:
    return FLAG in argv


def rewrite_argv(argv: Sequence[str], threshold: int | None = None) -> list[str]:
    """SGLang's flags for `--enable-ct-hpkv`; `argv` unchanged when the flag is absent.

    `threshold` (tokens) defaults to HPKV's configured VLLM_HPKV_TOKEN_THRESHOLD.
    """
    argv = list(argv)
    if not wants_hpkv(argv):
        return argv
    # Spelled out first: an abbreviated --conf must be expanded like --config.
    argv = _expand_config(_spell_out([arg for arg in argv if arg != FLAG]))
    if threshold is None:
        threshold = token_threshold()
    if not any(flag in argv for flag in _HICACHE_ON):
        argv.append(_HICACHE_ON[0])
    backend = _value(argv, _BACKEND)
    if backend is None:
        argv += [_BACKEND, "dynamic"]
    elif backend != "dynamic":
        log.warning("--enable-ct-hpkv: %s %s was given, so HPKV is not SGLang's storage backend", _BACKEND, backend)
        return argv
    _set_extra_config(argv, threshold)
    if not _on_npu(argv):
        argv += _host_layout(argv)
    return argv


def _host_layout(argv: list[str]) -> list[str]:
    """The host layout and io backend flags HPKV adds: none the user gave (see the rules above)."""
    layout_given, io_given = _value(argv, _LAYOUT) is not None, _value(argv, _IO) is not None
    if _value(argv, "--device") != "cpu":
        return [] if layout_given or io_given else [_LAYOUT, "page_first"]
    added = [] if layout_given or io_given else [_LAYOUT, "page_first_direct"]
    return added + ([] if io_given else [_IO, "direct"])


def backend_config(threshold: int) -> dict:
    """The keys of the extra-config that select HPKV's backend with the zero-copy v1 interface."""
    return {
        "backend_name": BACKEND_NAME,
        "module_path": BACKEND_MODULE,
        "class_name": BACKEND_CLASS,
        "interface_v1": 1,
        "prefetch_threshold": threshold,
    }


def token_threshold() -> int:
    """HPKV's load threshold in tokens (config file > env > default), for SGLang's prefetch."""
    from ...config import load_settings

    threshold = load_settings().token_threshold
    if threshold is None:
        log.warning(
            "VLLM_HPKV_TOKEN_THRESHOLD=auto has no cost model under SGLang (SGLang loads HPKV's pages "
            "while a request waits, not on the step that computes it, and HPKV sees no step to learn "
            "from): SGLang's prefetch_threshold is %d tokens; set a number to tune it (docs/sglang.md, "
            "Tuning)",
            DOCUMENTED_THRESHOLD,
        )
        return DOCUMENTED_THRESHOLD
    return threshold


def _set_extra_config(argv: list[str], threshold: int) -> None:
    ours = backend_config(threshold)
    given = _value(argv, _EXTRA)
    if given is None:
        argv += [_EXTRA, json.dumps(ours)]
        return
    try:
        theirs = json.loads(given)
    except ValueError:
        theirs = None
    if not isinstance(theirs, dict):
        log.warning(
            "--enable-ct-hpkv: %s is not an inline JSON object (%.60s); it is left as given, so it must "
            "name HPKV's backend itself: %s",
            _EXTRA,
            given,
            json.dumps(ours),
        )
        return
    _replace_value(argv, _EXTRA, json.dumps({**ours, **theirs}))


def _on_npu(argv: list[str]) -> bool:
    device = _value(argv, "--device")
    if device is not None:
        return device.startswith("npu")
    return importlib.util.find_spec("torch_npu") is not None


def _parser():
    """SGLang's own argument parser, as prepare_server_args builds it."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser


def _expand_config(argv: list[str]) -> list[str]:
    """Inline SGLang's `--config FILE` the way prepare_server_args would, so the HiCache flags
    the file sets count as given (they would otherwise lose to the ones added here)."""
    if "--config" not in argv:
        return argv
    from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger

    return list(ConfigArgumentMerger(_parser()).merge_config_with_args(argv))


def _spell_out(argv: list[str]) -> list[str]:
    """Every flag abbreviated to a unique prefix, as `--name` or `--name=V`, written in full, as
    argparse (allow_abbrev) would read it. An ambiguous or unknown one stays: argparse refuses it."""
    names = None
    out: list[str] = []
    for i, arg in enumerate(argv):
        if arg == "--":  # the rest are values
            return out + argv[i:]
        flag, eq, value = arg.partition("=")
        if flag.startswith("--") and len(flag) > 2:
            if names is None:
                parser = _parser()
                names = [name for action in parser._actions for name in action.option_strings]
            if flag not in names:
                matches = [name for name in names if name.startswith(flag)]
                if len(matches) == 1:
                    arg = matches[0] + eq + value
        out.append(arg)
    return out


def _value(argv: list[str], name: str) -> str | None:
    """The last value given for `name` (argparse keeps the last), as `name V` or `name=V`."""
    found = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            found = argv[i + 1]
        elif arg.startswith(name + "="):
            found = arg[len(name) + 1 :]
    return found


def _replace_value(argv: list[str], name: str, value: str) -> None:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            argv[i + 1] = value
        elif arg.startswith(name + "="):
            argv[i] = f"{name}={value}"
