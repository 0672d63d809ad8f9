"""``python -m dynamo.router``: Dynamo 1.x's entry point; its command line is cli/v1/router.py."""
