"""The SLA planner: adds and removes workers to hold TTFT and ITL targets as load changes."""
