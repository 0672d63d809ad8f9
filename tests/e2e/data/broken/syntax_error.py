async def generate(request)
    yield {}
