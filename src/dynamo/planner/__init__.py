"""The planner: adds and removes workers so a fleet holds its TTFT and ITL targets as load changes
(docs/planner.md).  ``dynamo-planner`` / ``python -m dynamo.planner``; the orchestrator's side of the
virtual connector is :class:`dynamo.planner.virtual_connector.VirtualConnectorClient`."""
