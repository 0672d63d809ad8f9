"""What the benchmarks share to start a deployment and feed it: real etcd and nats-server
(:mod:`.servers`), ``dynamo-run`` frontends and workers (:mod:`.procs`), model folders built or found
offline (:mod:`.models`), and a deterministic token engine for fault runs (``det_engine.py``).

The load generator and the result helpers shared by the comparisons are :mod:`benchmarks.loadgen` and
:mod:`benchmarks.echo_compare`.  See benchmarks/README.md.
"""
