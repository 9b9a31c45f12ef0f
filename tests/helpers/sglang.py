"""Real SGLang for the tests: real SGLang modules on a CPU-only machine, the documented
command lines, real SGLang host KV pools, SGLang-style page keys, and HPKV's entry points.

- `sglang_modules()`: imports the SGLang modules the tests use. SGLang's host pools import its
  model configs, which import torchvision at module level (InternVL and DeepSeek-OCR image
  transforms). PyPI's torchvision is linked against CUDA torch and cannot load beside the CPU
  torch here (the Makefile removes it), so when no working torchvision is installed a stand-in
  package serves those imports for the duration of this one import and is removed afterwards.
  It is never called: nothing on the paths tested touches images. transformers is asked first,
  so it keeps believing (correctly) that torchvision is absent.
- `entry_points_visible(dir)`: HPKV's `sglang.serve_backends` / `sglang.srt.plugins` entry points,
  as pyproject.toml declares them. When the installed ct-hpkv metadata does not have them yet
  (an editable install made before they were added), a one-file distribution declaring exactly
  `ENTRY_POINTS` is put on sys.path (and on PYTHONPATH for subprocesses).
- `host_pool(kind, layout, ...)`: a real `MHATokenToKVPoolHost`/`MLATokenToKVPoolHost` built the
  way SGLang builds it, from a real device pool on the CPU, with random page contents.
- `tiny_model(dir)` and `published(argv)`: a model directory with just a config.json, and SGLang's
  server arguments for a command line, parsed and published the way a scheduler process does
  before it builds its cache (`--device cpu`: there is no accelerator here).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.abc
import importlib.machinery
import json
import logging
import os
import struct
import sys
import tempfile
import types
from contextlib import contextmanager
from functools import lru_cache
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from helpers.env import pythonpath, use_hpkv_env, without_hpkv

pytest.importorskip("sglang", reason="SGLang is not installed (make setup installs it)")

import torch  # noqa: E402

MODEL = "/mnt/data/models/Qwen/Qwen2.5-1.5B-Instruct"
SERVED = "qwen2.5-1.5b"
# The documented commands (spec/quickstart.en.md, SGLang), after `sglang serve`.
GPU_ARGV = [
    "--model-path",
    MODEL,
    "--enable-ct-hpkv",
    "--host",
    "0.0.0.0",
    "--port",
    "8000",
    "--page-size",
    "64",
    "--served-model-name",
    SERVED,
]
ASCEND_ARGV = GPU_ARGV + ["--device", "npu", "--attention-backend", "ascend"]
ASCEND_ENV = {
    "SGLANG_SET_CPU_AFFINITY": "1",
    "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True",
    "STREAMS_PER_DEVICE": "32",
}
# The original document's order: the flag between --model-path and the path.
ORIGINAL_ORDER_ARGV = ["--model-path", "--enable-ct-hpkv", MODEL, *GPU_ARGV[3:]]

HOST_BUDGET_BYTES = 64 << 20

ENTRY_POINTS = {
    "sglang.serve_backends": {"ct_hpkv": "hpkv.integrations.sglang.plugin:serve_backend"},
    "sglang.srt.plugins": {"ct_hpkv": "hpkv.integrations.sglang.plugin:register"},
}


# -- SGLang's modules ------------------------------------------------------------------------


@lru_cache(maxsize=1)
def sglang_modules() -> types.SimpleNamespace:
    from transformers.utils.import_utils import is_torchvision_available

    is_torchvision_available()  # cached: transformers must not take the stand-in for the real thing
    names = {
        "hicache_storage": "sglang.srt.mem_cache.hicache_storage",
        "factory": "sglang.srt.mem_cache.storage.backend_factory",
        "memory_pool": "sglang.srt.mem_cache.memory_pool",
        "mha_host": "sglang.srt.mem_cache.pool_host.mha",
        "mla_host": "sglang.srt.mem_cache.pool_host.mla",
        "host_base": "sglang.srt.mem_cache.pool_host.base",
        "hybrid_controller": "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller",
    }
    with _torchvision_stand_in():
        return types.SimpleNamespace(**{short: importlib.import_module(name) for short, name in names.items()})


class _Placeholder:
    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, name: str) -> _Placeholder:
        return _Placeholder(f"{self._name}.{name}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name} is the tests' torchvision stand-in")


class _StandInModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{self.__name__}.{name}")


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StandInModule(spec.name)

    def exec_module(self, module) -> None:
        module.__path__ = []


class _torchvision_stand_in:
    def __enter__(self) -> None:
        self.finder = None
        try:
            import torchvision  # noqa: F401
        except Exception:  # absent, or a CUDA build that cannot load beside CPU torch
            self.finder = _StandInFinder()
            sys.meta_path.insert(0, self.finder)

    def __exit__(self, *exc) -> None:
        if self.finder is None:
            return
        sys.meta_path.remove(self.finder)
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]


class root_logging_kept:
    """prepare_server_args calls logging.basicConfig(force=True); give the root logger back."""

    def __enter__(self) -> None:
        root = logging.getLogger()
        self.saved = (list(root.handlers), root.level)

    def __exit__(self, *exc) -> None:
        root = logging.getLogger()
        handlers, level = self.saved
        for handler in list(root.handlers):
            if handler not in handlers:
                root.removeHandler(handler)
        for handler in handlers:
            if handler not in root.handlers:
                root.addHandler(handler)
        root.setLevel(level)


# -- entry points -----------------------------------------------------------------------------


def _installed(group: str, name: str, value: str) -> bool:
    return any(ep.name == name and ep.value == value for ep in entry_points(group=group))


def entry_points_visible(directory: Path) -> str | None:
    """Make ENTRY_POINTS discoverable; returns the directory added to the path, if one was."""
    if all(_installed(g, n, v) for g, eps in ENTRY_POINTS.items() for n, v in eps.items()):
        return None
    dist = Path(directory) / "hpkv_sglang_entry_points-0.0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: hpkv-sglang-entry-points\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text(
        "".join(
            f"[{group}]\n" + "".join(f"{name} = {value}\n" for name, value in eps.items()) + "\n"
            for group, eps in ENTRY_POINTS.items()
        )
    )
    sys.path.insert(0, str(directory))
    importlib.invalidate_caches()
    return str(directory)


def subprocess_env(extra_path: str | None, **env: str) -> dict[str, str]:
    return {**without_hpkv(), "PYTHONPATH": pythonpath(extra_path), "HF_HUB_OFFLINE": "1", **env}


# -- server arguments -------------------------------------------------------------------------

TINY_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 3,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": True,
}


def tiny_model(directory: Path, **config) -> Path:
    """A model directory SGLang can resolve its arguments against (no weights: nothing loads them)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({**TINY_CONFIG, **config}))
    return directory


@contextmanager
def published(argv: list[str]):
    """SGLang's server arguments for `argv`, published in this process as its scheduler
    processes publish them (`run_scheduler_process`), for the duration of the block."""
    sglang_modules()  # the torchvision stand-in, before SGLang's model configs are imported
    from sglang.srt.runtime_context import create_context, use_context
    from sglang.srt.server_args import prepare_server_args

    offline = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        with root_logging_kept():
            args = prepare_server_args([*map(str, argv), "--device", "cpu"])
        context = create_context(args, role="scheduler")
    finally:
        if offline is None:
            del os.environ["HF_HUB_OFFLINE"]
        else:
            os.environ["HF_HUB_OFFLINE"] = offline
    with use_context(context):
        yield args


# -- host pools -------------------------------------------------------------------------------


def host_pool(
    kind: str = "mha",
    layout: str = "page_first",
    page_size: int = 4,
    num_layers: int = 3,
    dtype: torch.dtype = torch.bfloat16,
    device_tokens: int = 64,
    seed: int | None = 0,
    start_layer: int = 0,
    **options,
):
    """A real SGLang host KV pool (2 x device_tokens slots) of the model layers from
    `start_layer` on (a pipeline stage), filled with random bytes unless `seed` is None (then
    zeros, as SGLang allocates it). `options` go to the host pool (MLA's layer_shard_enabled)."""
    # SGLang refuses a host pool when the machine has under 10 GiB free (engines in other tests
    # may hold that much); a budget of its own for these few kilobytes, the way SGLang books
    # the pools of one start-up against one snapshot.
    with sglang_modules().host_base.host_memory_budget_scope(HOST_BUDGET_BYTES):
        pool = _host_pool(kind, layout, page_size, num_layers, dtype, device_tokens, start_layer, options)
    if seed is not None:
        flat = pool.kv_buffer.view(-1).view(torch.uint8)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    return pool


def _host_pool(kind, layout, page_size, num_layers, dtype, device_tokens, start_layer, options):
    sg = sglang_modules()
    common = dict(size=device_tokens, page_size=page_size, dtype=dtype, layer_num=num_layers, device="cpu")
    common.update(enable_memory_saver=False, start_layer=start_layer, end_layer=start_layer + num_layers - 1)
    if kind == "mha":
        device = sg.memory_pool.MHATokenToKVPool(head_num=2, head_dim=8, **common)
        host_class, extra = sg.mha_host.MHATokenToKVPoolHost, {}
    elif kind == "mla":
        device = sg.memory_pool.MLATokenToKVPool(kv_lora_rank=16, qk_rope_head_dim=8, **common)
        host_class = sg.mla_host.MLATokenToKVPoolHost
        extra = {"target_layer_num": device.layer_num, "override_kv_cache_dim": device.kv_cache_dim}
    else:
        raise ValueError(kind)
    return host_class(
        device.get_device_pool_infos()[0].buffer_info,
        2.0,
        0,
        page_size,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=device.size,
        start_layer=device.start_layer,
        end_layer=device.end_layer,
        **extra,
        **options,
    )


def page_bytes(pool, first_index: int) -> bytes:
    """Every byte of the page starting at host slot `first_index`, through SGLang's own accessor."""
    return pool.get_data_page(first_index, flat=True).contiguous().view(torch.uint8).numpy().tobytes()


def page_indices(pool, pages: list[int]) -> torch.Tensor:
    """Host indices (token slots) of the given page numbers, as SGLang passes them."""
    size = pool.page_size
    return torch.cat([torch.arange(p * size, (p + 1) * size, dtype=torch.int64) for p in pages])


# -- keys -------------------------------------------------------------------------------------


def page_hashes(prompt: str, num_pages: int, page_size: int = 4) -> list[str]:
    """SGLang's storage keys for a prompt: SHA-256 chained page by page over the token ids
    (uint32 little-endian), as hex (sglang/srt/mem_cache/utils.py get_hash_str)."""
    tokens = [b for b in hashlib.sha256(prompt.encode()).digest() * (num_pages * page_size // 32 + 1)]
    keys, prior = [], b""
    for p in range(num_pages):
        digest = hashlib.sha256(prior + struct.pack(f"<{page_size}I", *tokens[p * page_size : (p + 1) * page_size]))
        prior = digest.digest()
        keys.append(digest.hexdigest())
    return keys


# -- HPKV -------------------------------------------------------------------------------------


def use_node_env(monkeypatch, node) -> None:
    """This process reads HPKV settings (and auto-starts servers) with the node's environment."""
    use_hpkv_env(monkeypatch, node.env)


def storage_config(
    model_name: str = SERVED,
    tp_rank: int = 0,
    tp_size: int = 1,
    is_mla: bool = False,
    extra: dict | None = None,
    pp_rank: int = 0,
    pp_size: int = 1,
    metrics: bool = False,
):
    """SGLang's HiCacheStorageConfig, as its cache controller fills it in for one rank."""
    sg = sglang_modules()
    return sg.hicache_storage.HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=pp_rank,
        pp_size=pp_size,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=is_mla,
        enable_storage_metrics=metrics,
        is_page_first_layout=False,
        model_name=model_name,
        extra_config=dict(
            extra
            if extra is not None
            else {
                "backend_name": "ct_hpkv",
                "module_path": "hpkv.integrations.sglang.backend",
                "class_name": "HpkvStorage",
                "interface_v1": 1,
            }
        ),
    )


def backend(pool, config=None):
    """The backend as SGLang's cache controller makes it: the real factory, then the host pool."""
    sg = sglang_modules()
    config = config or storage_config()
    storage = sg.factory.StorageBackendFactory.create_backend("dynamic", config, pool)
    with own_extensions_dir():  # registration loads (the first time builds) SGLang's page hash
        storage.register_mem_pool_host(pool)
    storage.identity.wait(60)  # the model's identity, read on a thread of its own: then the namespace
    return storage


@contextmanager
def own_extensions_dir():
    """torch builds SGLang's page-hash extension in one directory per extension name, whatever
    the SGLang path, and rebuilds it (15-20 s here) whenever another path loads it: this
    interpreter's SGLang gets a directory of its own, the serving engines' (.venv-sglang) keep
    the one `make setup` built."""
    tag = hashlib.sha256(sys.prefix.encode()).hexdigest()[:12]
    own = Path(tempfile.gettempdir()) / f"hpkv-tests-torch-extensions-{tag}"
    saved = os.environ.get("TORCH_EXTENSIONS_DIR")
    os.environ["TORCH_EXTENSIONS_DIR"] = str(own)
    try:
        yield
    finally:
        if saved is None:
            del os.environ["TORCH_EXTENSIONS_DIR"]
        else:
            os.environ["TORCH_EXTENSIONS_DIR"] = saved
