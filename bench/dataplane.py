"""The data-plane benchmark, as `hpkv bench` runs it: python bench/dataplane.py [--help]."""
import sys
from hpkv.cli import main
main(["bench", *sys.argv[1:]], prog_name="hpkv")
