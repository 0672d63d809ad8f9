"""``python -m dynamo.mistralrs``: Dynamo 1.x's entry point; its command line is cli/v1/mistralrs.py."""
