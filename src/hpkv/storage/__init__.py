"""The storage tier: self-describing checksummed files (`format`), the file I/O seam (`fileio`) and
the tier with its index, capacity and eviction (`tier`). No torch, no engines."""
