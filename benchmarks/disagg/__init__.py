"""Disaggregated prefill/decode benchmarks: the KV transfer, and decode ITL with and without it."""
