"""Response parsers: tool calls and reasoning, from a model's text to OpenAI deltas.

``registry`` names them (``--tool-call-parser``, ``--reasoning-parser``) and detects them from a chat
template; ``stage`` wires them into a request's stream; ``fold`` builds the unary message.
"""
