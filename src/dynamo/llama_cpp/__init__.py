"""``python -m dynamo.llama_cpp``: Dynamo 1.x's entry point; its command line is cli/v1/llama_cpp.py."""
