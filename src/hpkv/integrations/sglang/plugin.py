"""SGLang's two entry points for HPKV; both make `--enable-ct-hpkv` work unchanged.

- `serve_backend()` (group `sglang.serve_backends`): `sglang serve` asks every installed
  backend's detector about the command line; ours claims it when `--enable-ct-hpkv` is there,
  rewrites the flag and launches SGLang's ordinary LLM server with the result.
- `register()` (group `sglang.srt.plugins`): SGLang runs general plugins in every process
  (`sglang serve`, `python -m sglang.launch_server`, schedulers, ...). Ours hooks
  `prepare_server_args`, SGLang's one parser of server arguments, so the flag is rewritten
  before argparse (which would reject it) on every entry point. SGLang rebinds the modules that
  imported `prepare_server_args` by name, `launch_server`'s `__main__` included.

The rewrite is idempotent, so both may run on one command line. Neither imports anything
heavy: detectors run for every `sglang serve`, plugins in every SGLang process. Outside the
tested SGLang range (`hpkv.integrations.versions`) `register()` says so in one line first.
"""

from __future__ import annotations

import logging
import sys

from ..versions import warn_once
from . import flag

log = logging.getLogger("hpkv.sglang")

PREPARE_SERVER_ARGS = "sglang.srt.server_args.prepare_server_args"
SERVE_BACKEND_API_VERSION = 1  # the sglang.serve_backends contract this module implements


def register() -> None:
    """The `sglang.srt.plugins` entry point: must never raise (SGLang logs and goes on)."""
    warn_once(log, "SGLang", sglang_version())
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        HookRegistry.register(PREPARE_SERVER_ARGS, _before_prepare_server_args, HookType.BEFORE)
    except Exception:
        log.exception("HPKV could not hook SGLang's argument parsing; --enable-ct-hpkv will be rejected")
    _log_level()


def sglang_version() -> str:
    """The installed SGLang's version, from its package metadata (importing sglang is heavy)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return "unknown"


def _log_level() -> None:
    """HPKV's records reach SGLang's handlers (through the root logger) at HPKV_LOG_LEVEL."""
    from ...config import load_settings
    from ...errors import ConfigError

    try:
        logging.getLogger("hpkv").setLevel(load_settings().log_level.upper())
    except ConfigError:
        pass  # reported, with its fix, where the setting is used


def _before_prepare_server_args(*args, **kwargs):
    """BEFORE hook: returns the (args, kwargs) to call prepare_server_args with, or None."""
    argv = kwargs["argv"] if "argv" in kwargs else (args[0] if args else None)
    if argv is None or not flag.wants_hpkv(argv):
        return None
    rewritten = _rewrite_or_exit(argv)
    if "argv" in kwargs:
        return args, {**kwargs, "argv": rewritten}
    return (rewritten, *args[1:]), kwargs


def serve_backend():
    """The `sglang.serve_backends` entry point: a zero-argument factory."""
    from sglang.cli.serve_backends import ServeBackend

    return ServeBackend(api_version=SERVE_BACKEND_API_VERSION, run=_run, detect=_detect, requires_model_path=True)


def _detect(request):
    from sglang.cli.serve_backends import ServeBackendDetection

    return ServeBackendDetection.MATCH if flag.wants_hpkv(request.argv) else ServeBackendDetection.NO_MATCH


def _run(request) -> None:
    """Launch SGLang's LLM server, as `sglang serve` does without HPKV, with the flag rewritten."""
    from sglang.srt.server_args import prepare_server_args

    argv = _rewrite_or_exit(request.argv)
    if "-h" in argv or "--help" in argv:
        try:
            prepare_server_args(["--help"])
        except SystemExit:
            pass
        return
    from sglang.launch_server import run_server

    run_server(prepare_server_args(argv))


def _rewrite_or_exit(argv) -> list[str]:
    """A bad HPKV configuration is a command-line error: say what to fix, as argparse would."""
    from ...errors import ConfigError

    try:
        return flag.rewrite_argv(argv)
    except ConfigError as exc:
        print(f"sglang serve: error: {flag.FLAG}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
