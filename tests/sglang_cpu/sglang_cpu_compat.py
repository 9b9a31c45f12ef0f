"""Test-only: what a real SGLang 0.5.23 lacks to serve with HiCache on a machine without a GPU.

Not part of HPKV (not in the wheel). The serving-SGLang tests, `make demo-sglang` and the SGLang
benchmark put this directory first on the engine's PYTHONPATH; its `sitecustomize` calls
`install()` in every Python process of the engine (the HTTP server, the tokenizer, each
scheduler). Every patch waits for the SGLang module it completes to be imported, changes one
name in it, and logs that it did. Each stands in for CUDA-only code on a path SGLang takes
with `--device cpu` and no `SGLANG_USE_CPU_ENGINE` (whose CPU kernels have no build on the
package index); none edits SGLang's files. The SGLang lines are those of the 0.5.23 wheel.

1. torchvision (`srt/multimodal/internvl_utils.py:5`, imported by the model configs): PyPI's
   build is CUDA-linked; its `_meta_registrations.py` registers fakes for `torchvision::nms`
   and `qnms`, whose schemas its `_C.so` would have defined. The schemas are defined first.
2. `vllm._custom_ops.rotary_embedding` (`srt/layers/rotary_embedding/base.py:138`): imported
   as a fallback kernel on this platform, never called (`forward_native` runs on a CPU).
3. Host pool allocation (`srt/mem_cache/pool_host/common.py:453`, `alloc_with_host_register`
   calls `torch.cuda.cudart()`): plain host memory for device "cpu".
4. HiCache "direct" transfer ops (`srt/mem_cache/pool_host/mha.py:60-88` binds them only on
   CUDA/HIP/XPU): pure-torch `transfer_kv_direct`, `transfer_kv_per_layer_direct_pf_lf`,
   `transfer_kv_all_layer_direct_lf_pf`, the indexed copies sgl-kernel's ops make.
5. L3 reads through the copying path (`pool_host/mha.py:728-733`, `get_dummy_flat_data_page`
   pins memory, which needs CUDA): the same page unpinned.
6. `torch.cpu.Stream` has no `synchronize` (`srt/mem_cache/l2_transfer.py:123`, an error path):
   a no-op, CPU work being synchronous, so the real error is raised.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import types

log = logging.getLogger("sglang_cpu_compat")
_installed = False


def _say(what: str) -> None:
    # Before SGLang configures logging, a record may have no handler: stderr, always.
    print(f"[sglang_cpu_compat] {what}", file=sys.stderr, flush=True)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `patch(module)` right after `name` is first executed; `before()` just before."""

    def __init__(self, name: str, patch=None, before=None) -> None:
        self.name, self.patch, self.before = name, patch, before

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        if self.before is not None:
            self.before()
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or self.patch is None:
            return spec
        run, patch = spec.loader.exec_module, self.patch

        def exec_module(module):
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


# -- 1. torchvision's operator schemas --------------------------------------------------------


def _torchvision_schemas() -> None:
    import torch

    if torch.cuda.is_available():
        return
    try:
        torch._C._dispatch_find_schema_or_throw("torchvision::nms", "")
        return  # a working torchvision build defined them
    except RuntimeError:
        pass
    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _keep.append(lib)
    _say("defined the torchvision::nms/qnms schemas (stand-in for the CUDA build's _C.so)")


_keep: list = []


# -- 2. the rotary fallback's import ----------------------------------------------------------


def _rotary_fallback() -> None:
    if importlib.util.find_spec("vllm") is not None:
        return
    module = types.ModuleType("vllm._custom_ops")

    def rotary_embedding(*args, **kwargs):
        raise RuntimeError("sglang_cpu_compat: vllm._custom_ops.rotary_embedding is not available on this CPU")

    module.rotary_embedding = rotary_embedding  # type: ignore[attr-defined]
    module.__spec__ = importlib.machinery.ModuleSpec("vllm._custom_ops", None)
    package = types.ModuleType("vllm")
    package.__spec__ = importlib.machinery.ModuleSpec("vllm", None, is_package=True)
    package.__path__ = []  # type: ignore[attr-defined]
    package._custom_ops = module  # type: ignore[attr-defined]
    sys.modules.setdefault("vllm", package)
    sys.modules.setdefault("vllm._custom_ops", module)
    _say("vllm._custom_ops.rotary_embedding: an import-time stand-in (rotary_embedding/base.py:138, never called)")


# -- 3. host pool allocation ------------------------------------------------------------------


def _host_alloc(common) -> None:
    import torch

    def alloc_plain(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
        return torch.empty(dims, dtype=dtype, device=device)

    common.ALLOC_MEMORY_FUNCS["cpu"] = alloc_plain
    _say("HiCache host pool on device cpu: plain host memory (pool_host/common.py:453, no cudaHostRegister)")


# -- 4 and 5. direct transfer ops, unpinned dummy page -----------------------------------------


def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
    """sgl_kernel.kvcacheio.transfer_kv_direct: dst[dst_indices] = src[src_indices], per layer."""
    src_indices, dst_indices = src_indices.long(), dst_indices.long()
    for src, dst in zip(src_layers, dst_layers):
        dst[dst_indices.to(dst.device)] = src[src_indices.to(src.device)].to(dst.device)


def transfer_kv_per_layer_direct_pf_lf(src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size):
    """Host [page, layer, slot, ...] (page_first_direct) -> device [token, ...], one layer."""
    src_indices, dst_indices = src_indices.long(), dst_indices.long()
    pages, slots = src_indices // page_size, src_indices % page_size
    for src, dst in zip(src_ptrs, dst_ptrs):
        dst[dst_indices.to(dst.device)] = src[pages, layer_id, slots].to(dst.device)


def transfer_kv_all_layer_direct_lf_pf(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size):
    """Device layers (every K, then every V) -> host [page, layer, slot, ...], all layers."""
    src_indices, dst_indices = src_indices.long(), dst_indices.long()
    pages, slots = dst_indices // page_size, dst_indices % page_size
    num_layers = len(src_ptrs) // len(dst_ptrs)
    for i, src in enumerate(src_ptrs):
        dst = dst_ptrs[i // num_layers]
        dst[pages, i % num_layers, slots] = src[src_indices.to(src.device)].to(dst.device)


def _mha_host(mha) -> None:
    import torch

    for op in (transfer_kv_direct, transfer_kv_per_layer_direct_pf_lf, transfer_kv_all_layer_direct_lf_pf):
        if not hasattr(mha, op.__name__):
            setattr(mha, op.__name__, op)
    _say("HiCache direct io ops: pure-torch indexed copies (pool_host/mha.py:60-88 binds them only on CUDA/HIP/XPU)")
    original = mha.MHATokenToKVPoolHost.get_dummy_flat_data_page

    def get_dummy_flat_data_page(self):
        if str(self.device) != "cpu":
            return original(self)
        shape = (2, self.layer_num, self.page_size, self.head_num, self.head_dim)
        return torch.zeros(shape, dtype=self.dtype, device="cpu").flatten()

    mha.MHATokenToKVPoolHost.get_dummy_flat_data_page = get_dummy_flat_data_page
    _say("HiCache L3 copying-path page on device cpu: unpinned (pool_host/mha.py:728-733)")


# -- 6. torch.cpu.Stream.synchronize -----------------------------------------------------------


def _cpu_stream(_l2_transfer) -> None:
    import torch

    if not hasattr(torch.cpu.Stream, "synchronize"):
        torch.cpu.Stream.synchronize = lambda self: None  # type: ignore[attr-defined]
        _say("torch.cpu.Stream.synchronize: a no-op (l2_transfer.py:123 calls it on its error path)")


def install() -> None:
    """Hook every patch on its module's first import (idempotent; only where there is no CUDA)."""
    global _installed
    if _installed:
        return
    _installed = True
    hooks = [
        _AfterImport("torchvision", before=_torchvision_schemas),
        _AfterImport("sglang.srt.layers.rotary_embedding.base", before=_rotary_fallback),
        _AfterImport("sglang.srt.mem_cache.pool_host.common", patch=_host_alloc),
        _AfterImport("sglang.srt.mem_cache.pool_host.mha", patch=_mha_host),
        _AfterImport("sglang.srt.mem_cache.l2_transfer", patch=_cpu_stream),
    ]
    for hook in hooks:
        sys.meta_path.insert(0, hook)


def warm() -> None:
    """Build SGLang's C++ page-hash extension now (g++, ~20 s), as its first L3 lookup would."""
    import sglang_cpu_compat  # the module sitecustomize installed, not this __main__ copy

    sglang_cpu_compat.install()
    from sglang.srt.mem_cache.cpp_utils.native_hash import get_native_hash

    digest = get_native_hash(list(range(64)), None, 64)
    _say(f"SGLang's native page hash is built (first page: {str(digest)[:16]}...)")


if __name__ == "__main__":
    if "--warm" in sys.argv:
        warm()
