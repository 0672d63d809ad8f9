"""A pytok engine whose load takes longer than the lease TTL the test sets (like a big model's)."""

import os
import time

time.sleep(float(os.environ.get("SLOW_LOAD_S", "3")))  # blocking, as a real load would be


async def generate(request):
    yield {"token_ids": request["token_ids"][:1], "finish_reason": "stop"}
