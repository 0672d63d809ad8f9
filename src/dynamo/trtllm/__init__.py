"""``python -m dynamo.trtllm``: Dynamo 1.x's entry point; its command line is cli/v1/trtllm.py."""
