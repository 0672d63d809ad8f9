"""Tool-call parsers, one module per format family; :mod:`dynamo.llm.parsers.registry` names them."""
