"""Test-only: every Python process started with this directory on PYTHONPATH (an SGLang engine
under test) gets the CPU compatibility layer (sglang_cpu_compat.py says what and why)."""

import sglang_cpu_compat

sglang_cpu_compat.install()
