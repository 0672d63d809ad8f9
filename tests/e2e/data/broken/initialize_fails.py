def initialize(args):
    raise ValueError(f"unknown option {args[-1]}")


async def generate(request):
    yield {}
