"""Cold start and warmup: staged capacity, prefix warmup from a Q&A set, LRU-K answer cache.

Nothing here yet; DESIGN.md "Warmup" describes what this package will own.
"""
