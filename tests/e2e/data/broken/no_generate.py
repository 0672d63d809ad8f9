async def generate_tokens(request):
    yield {}
