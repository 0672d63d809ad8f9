"""The KV router benchmarks: the end-to-end sweep (run.py, workload.py) and the index at scale (scale.py)."""
