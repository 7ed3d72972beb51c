"""Cold start and warmup: the staged capacity ramp of a starting worker (``ramp``); prefix warmup from a
Q&A set and the LRU-K answer cache are still to come (DESIGN.md "Warmup")."""
