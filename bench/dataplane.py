"""The data-plane benchmark, as `hpkv bench` runs it: `python -m bench.dataplane [--help]`."""

import sys

from hpkv.cli import main

if __name__ == "__main__":
    main(["bench", *sys.argv[1:]], prog_name="hpkv")
