"""The storage tier: self-describing checksummed files (`format`), the file I/O seam (`fileio`),
the tier with its index, capacity and eviction (`storage_tier`) and the write-through processes that
write entry files for the server (`writer`). No torch, no engines."""
