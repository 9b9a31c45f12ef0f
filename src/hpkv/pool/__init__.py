"""The DRAM tier: a shared-memory pool file (`region`), its slot allocator (`slots`) and the index
of entries held in it (`dram_tier`, `entry`). No torch, no engines."""
