"""`hpkv demo`: the quick-start scenarios walked on a real engine."""
