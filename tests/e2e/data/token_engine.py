"""Test engine (pytok): answers with real token ids of the served model's tokenizer (--model-path)."""

import argparse
import json
import sys

from tokenizers import Tokenizer

parser = argparse.ArgumentParser()
parser.add_argument("--model-path", required=True)
args, _ = parser.parse_known_args(sys.argv[1:])
TOKENIZER = Tokenizer.from_file(args.model_path + "/tokenizer.json")
ANSWER = TOKENIZER.encode("The capital of France is Paris.", add_special_tokens=False).ids


async def generate(request):
    prompt = TOKENIZER.decode(request["token_ids"])
    if "raise" in prompt:
        raise KeyError("no such token")
    if "bad-item" in prompt:
        yield {"tokens": ["x"]}
        return
    if "show-request" in prompt:
        summary = {
            "keys": sorted(request),
            "stop_conditions": sorted(request["stop_conditions"]),
            "sampling_options": sorted(request["sampling_options"]),
            "max_tokens": request["stop_conditions"]["max_tokens"],
            "temperature": request["sampling_options"]["temperature"],
            "eos_token_ids": request["eos_token_ids"],
            "prompt_is_ids": all(isinstance(t, int) for t in request["token_ids"]),
        }
        for tid in TOKENIZER.encode(json.dumps(summary, sort_keys=True), add_special_tokens=False).ids:
            yield {"token_ids": [tid]}
        yield {"token_ids": [], "finish_reason": "stop"}
        return
    logprobs = request["output_options"]["logprobs"]  # not None: the client asked for logprobs
    for tid in ANSWER:
        if logprobs is None:
            yield {"token_ids": [tid]}
        else:
            yield {"token_ids": [tid], "log_probs": [-0.25], "top_logprobs": [[{"token_id": tid, "logprob": -0.25}]]}
    yield {"token_ids": [], "finish_reason": "stop"}


generate.logprobs = True  # it yields log_probs when asked (not the prompt's: echo + logprobs is a 400)
