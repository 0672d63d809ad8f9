"""``python -m dynamo.vllm``: Dynamo 1.x's entry point; its command line is cli/v1/vllm.py."""
