async def generate(request):
    return {"choices": []}
