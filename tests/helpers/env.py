"""The HPKV environment of tests and of what they start: which variables configure HPKV, an
environment without them, and the PYTHONPATH that lets a child import these helpers."""

from __future__ import annotations

import os
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parents[1]
# Every variable that configures HPKV; tests build each process's HPKV environment from nothing.
HPKV_ENV_PREFIXES = ("HPKV_", "VLLM_HPKV_", "VLLM_ENABLE_HPKV")


def without_hpkv(environ=None) -> dict[str, str]:
    """`environ` (this process's by default) less every HPKV variable."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if not k.startswith(HPKV_ENV_PREFIXES)}


def clear_hpkv(monkeypatch) -> None:
    """This process forgets its HPKV variables for the test."""
    for name in [n for n in os.environ if n.startswith(HPKV_ENV_PREFIXES)]:
        monkeypatch.delenv(name)


def use_hpkv_env(monkeypatch, env: dict[str, str]) -> None:
    """This process reads HPKV settings (and auto-starts servers) with `env`'s HPKV variables only."""
    clear_hpkv(monkeypatch)
    for name, value in env.items():
        if name.startswith(HPKV_ENV_PREFIXES):
            monkeypatch.setenv(name, value)


def pythonpath(*first: str | None) -> str:
    """A PYTHONPATH for a child: `first`, then tests/ (for `helpers`), then this process's."""
    return os.pathsep.join(p for p in (*first, str(TESTS_DIR), os.environ.get("PYTHONPATH")) if p)
