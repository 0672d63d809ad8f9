import argparse
import sys

parser = argparse.ArgumentParser()
parser.add_argument("--engine-args", required=True)
parser.parse_known_args(sys.argv[1:])


async def generate(request):
    yield {}
