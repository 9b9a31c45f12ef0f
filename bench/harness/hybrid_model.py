"""Random hybrid models built locally with the demo's tokenizer. A Gemma 3 text model
(`Gemma3ForCausalLM`): layers alternating a sliding window and full attention, so that vLLM's
hybrid KV cache manager keeps a sliding-window KV cache group beside a full-attention one. A
Qwen3-Next (`Qwen3NextForCausalLM`): three Gated DeltaNet (linear-attention) layers and one full
attention layer, a Mamba-state group per linear layer. The tests serve the tiny shapes, the
hybrid benchmark wider ones. Primitives: `build_gemma3(path, shape)`, `build_qwen3_next(path,
shape)`, `TINY`, `BENCH`, `TINY_NEXT`, `BENCH_NEXT`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from hpkv.demo.model import config_sizes


@dataclass(frozen=True)
class Gemma3Shape:
    hidden_size: int = 192
    intermediate_size: int = 384
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    window: int = 128


TINY = Gemma3Shape()
BENCH = Gemma3Shape(hidden_size=1024, intermediate_size=2816, num_layers=8, num_heads=16, num_kv_heads=4)


def build_gemma3(path: Path, shape: Gemma3Shape = TINY) -> Path:
    """Write the model to `path` (skipped if that shape is built there already)."""

    def model(vocab_size: int):
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        config = Gemma3TextConfig(
            **config_sizes(shape, vocab_size),
            head_dim=shape.head_dim,
            query_pre_attn_scalar=shape.head_dim,
            sliding_window=shape.window,
            layer_types=["sliding_attention", "full_attention"] * (shape.num_layers // 2),
            **_COMMON,
        )
        return Gemma3ForCausalLM(config)

    return _build(Path(path), {"family": "gemma3", "shape": asdict(shape)}, model)


@dataclass(frozen=True)
class Qwen3NextShape:
    hidden_size: int = 256
    intermediate_size: int = 512
    num_layers: int = 4  # every fourth one full attention, the rest Gated DeltaNet
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    num_experts: int = 4


TINY_NEXT = Qwen3NextShape()
BENCH_NEXT = Qwen3NextShape(hidden_size=1024, intermediate_size=2048, num_layers=8, num_heads=16, num_kv_heads=4)


def build_qwen3_next(path: Path, shape: Qwen3NextShape = TINY_NEXT) -> Path:
    """Write the model to `path` (skipped if that shape is built there already)."""

    def model(vocab_size: int):
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        config = Qwen3NextConfig(
            **config_sizes(shape, vocab_size),
            head_dim=shape.head_dim,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            linear_conv_kernel_dim=4,
            num_experts=shape.num_experts,
            num_experts_per_tok=2,
            moe_intermediate_size=shape.intermediate_size // 4,
            shared_expert_intermediate_size=shape.intermediate_size // 4,
            layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (shape.num_layers // 4),
            **_COMMON,
        )
        return Qwen3NextForCausalLM(config)

    return _build(Path(path), {"family": "qwen3_next", "shape": asdict(shape)}, model)


# What every model here shares: long positions, its own head, bf16, token 0 for the specials.
_COMMON = dict(
    max_position_embeddings=32768,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
)


def _build(path: Path, spec: dict, model) -> Path:
    """The tokenizer, then `model(vocab_size)` with seeded random weights, saved with a marker
    naming `spec` and the seed, so that a path already holding them is left as it is."""
    from hpkv.demo.model import SEED, _build_tokenizer

    marker = path / "hpkv-model.json"
    spec = {**spec, "seed": SEED}
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return path
    import torch

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer(path)
    torch.manual_seed(SEED)
    model(len(tokenizer)).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    marker.write_text(json.dumps(spec))
    return path
