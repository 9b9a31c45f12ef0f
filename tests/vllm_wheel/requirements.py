"""The requirements of the installed vLLM wheel that its pure-Python modules need on a CPU, for
`make test-vllm-wheel`: its own list less torch's family (kept at this venv's CPU torch) and
the packages of its CUDA kernels, which neither install nor run without a GPU.

Prints one requirement a line, markers kept, with this venv's torch pinned first.
"""

from __future__ import annotations

import importlib.metadata
import re

# torch's family stays at this machine's CPU build; the rest are CUDA kernels and their tools.
LEFT_OUT = re.compile(
    r"^(torch|torchaudio|torchvision|torchcodec|pynvvideocodec|flashinfer.*|apache-tvm-ffi|tilelang|nvidia-.*|nvtx|"
    r"fastsafetensors|instanttensor|quack-kernels|tokenspeed-.*|humming-kernels|zentorch)$",
    re.IGNORECASE,
)


def main() -> None:
    torch_version = importlib.metadata.version("torch").split("+")[0]
    print(f"torch=={torch_version}")
    for requirement in importlib.metadata.requires("vllm") or []:
        if "extra ==" in requirement:
            continue
        name = re.split(r"[\s<>=!~;\[(]", requirement, maxsplit=1)[0]
        if not LEFT_OUT.match(name):
            print(requirement)


if __name__ == "__main__":
    main()
