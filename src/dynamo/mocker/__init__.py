"""``python -m dynamo.mocker``: Dynamo 1.x's entry point; the command line is cli/v1/mocker.py."""
