"""Benchmarks, a package so they can share code without path tricks: run each from the repository root
as ``python -m benchmarks.<name>`` (``benchmarks.router.run``...).  See benchmarks/README.md."""
