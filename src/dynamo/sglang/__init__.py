"""``python -m dynamo.sglang``: Dynamo 1.x's entry point; its command line is cli/v1/sglang.py."""
