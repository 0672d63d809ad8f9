"""What a worker tells the KV router about its cache: block hashing, the event wire format,
the publisher and per-worker cache bookkeeping.  Engines use these; the router that
consumes them is :mod:`dynamo.frontend.kv_router`."""
