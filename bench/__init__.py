"""Load generator, simulator harness, reports and plots.

Nothing here yet; the benchmark issue builds it (WORKLOADS.md describes the workloads).
"""
