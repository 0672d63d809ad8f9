"""Test engine: records sys.argv (as the seeds' docs show, from the __main__ block) and initialize()'s args."""

import json
import os
import sys

import argv_engine_helper  # found because the engine file's folder is first on sys.path

RECORD = {"main": None, "initialize": None, "helper": argv_engine_helper.NAME}


def _save():
    path = os.environ.get("DYN_TEST_ARGV_OUT")
    if path:
        with open(path, "w") as f:
            json.dump(RECORD, f)


def initialize(args):
    RECORD["initialize"] = list(args)
    RECORD["argv_at_initialize"] = list(sys.argv)
    _save()


async def generate(request):
    yield {"id": "1", "object": "chat.completion.chunk", "created": 1, "model": "m",
           "choices": [{"index": 0, "delta": {"role": "assistant", "content": "argv ok"}, "finish_reason": "stop"}]}


if __name__ == "__main__":
    print(f"MAIN: {sys.argv}")
    RECORD["main"] = list(sys.argv)
    _save()
