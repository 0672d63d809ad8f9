import os

WEIGHTS = "/nonexistent/weights.bin"
if not os.path.exists(WEIGHTS):
    raise RuntimeError(f"cannot load weights from {WEIGHTS}")


async def generate(request):
    yield {}
