"""HPKV: a tiered KV cache for LLM inference engines (shared DRAM pool + persistent storage)."""

__version__ = "0.1.0"
