"""Dynamo 1.x's command lines (``python -m dynamo.frontend``, ``dynamo.mocker``, ``dynamo.router``, the worker
modules), each mapped onto what ``dynamo-run`` starts; one module per entry point, the shared parts in
:mod:`dynamo.cli.v1.common`.  The table of every 1.x flag and what becomes of it is docs/cli-1x.md."""
