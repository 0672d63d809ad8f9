"""The ``dynamo`` umbrella command: ``dynamo serve`` here, ``dynamo run`` handed to ``dynamo-run``."""
