"""Small random-weight models and a tokenizer, built locally (no downloads), seeded so every build
is byte-identical: the demo, the tests and the benchmarks serve them with a real vLLM.

A word-level tokenizer is trained with `tokenizers` on a generated corpus; the model is a Qwen2
(the architecture of the documented Qwen2.5 example) with random weights.
"""

from __future__ import annotations

import contextlib
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

VOCAB_WORDS = 2000
SEED = 1234


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    max_position: int = 32768


TINY = ModelShape()
# Prefill must cost real time for benchmarks: wider and deeper, still random.
BENCH = ModelShape(hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=4, intermediate_size=2816)


def words(count: int = VOCAB_WORDS) -> list[str]:
    rng = random.Random(SEED)
    letters = "abcdefghijklmnopqrstuvwxyz"
    out: set[str] = set()
    while len(out) < count:
        out.add("".join(rng.choice(letters) for _ in range(rng.randint(3, 9))))
    return sorted(out)


def prompt_text(num_words: int, seed: int) -> str:
    """A deterministic prompt of `num_words` vocabulary words (about one token each)."""
    vocab = words()
    rng = random.Random(seed)
    return " ".join(rng.choice(vocab) for _ in range(num_words))


def build_model(path: Path, shape: ModelShape = TINY) -> Path:
    """Write a tokenizer and a random Qwen2 model to `path` (skipped if already built)."""
    path = Path(path)
    marker = path / "hpkv-model.json"
    spec = {"shape": shape.__dict__, "seed": SEED, "vocab_words": VOCAB_WORDS}
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return path
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer(path)
    _build_weights(path, shape, vocab_size=len(tokenizer))
    marker.write_text(json.dumps(spec))
    return path


def _build_tokenizer(path: Path):
    # Byte-level BPE, like Qwen2's own tokenizer: transformers loads a Qwen2 model's tokenizer as
    # Qwen2Tokenizer from vocab and merges, whatever class the files name.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_WORDS * 4,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    vocab = words()
    corpus = [" " + " ".join(vocab[i : i + 20]) for i in range(0, len(vocab), 20)]
    tok.train_from_iterator(corpus * 3, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
    )
    fast.save_pretrained(path)
    return fast


def config_sizes(shape, vocab_size: int) -> dict[str, int]:
    """The sizes a transformers config takes, from a shape with ModelShape's field names (the
    hybrid models' shapes have them too)."""
    return {
        "vocab_size": vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
    }


def _build_weights(path: Path, shape: ModelShape, vocab_size: int) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(SEED)
    config = Qwen2Config(
        **config_sizes(shape, vocab_size),
        max_position_embeddings=shape.max_position,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
        bos_token_id=0,
        eos_token_id=0,
    )
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    with _no_progress_bar():  # a one-shard bar would land amid the demo's own lines
        model.save_pretrained(path, safe_serialization=True)


@contextlib.contextmanager
def _no_progress_bar() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()
