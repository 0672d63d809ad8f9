"""Disaggregated prefill/decode: the KV transfer (``transfer``), the worker's role (``mode``) and the
frontend's decision where a prompt is prefilled (``plan``).  See docs/disaggregation.md."""
