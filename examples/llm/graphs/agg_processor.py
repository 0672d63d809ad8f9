"""Aggregated serving through a Processor, the original's 0.x layout: Frontend -> Processor -> Worker.

    cd examples/llm
    dynamo serve graphs.agg_processor:Frontend -f configs/agg_processor.yaml

The frontend serves only the Processor's namespace (``Frontend: namespace``) and forwards chat requests
to it unchanged; the Processor templates, tokenizes and routes them to the workers, which register in a
namespace of their own (``Worker: endpoint``).  One process hop more than ``agg``, where the frontend does
the Processor's work itself.
"""

from graphs.components import Frontend, Processor, Worker

Frontend.link(Processor)

__all__ = ["Frontend", "Processor", "Worker"]
