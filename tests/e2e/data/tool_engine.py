"""Test engine (pytok): answers as Qwen3 does in a tool loop, with real token ids of the served model.

First turn (the prompt lists tools): reasoning in <think>, a sentence, then one <tool_call>.  Once the
prompt holds our call and its <tool_response>, the final answer.  With thinking turned off (the template
closed an empty think block) no reasoning is written.  A prompt with no tools gets a plain answer.
Under guided decoding (tool_choice required / a named function) it writes the JSON the schema asks for:
an array of calls, or the arguments object; it says it honours guided decoding (the attribute below).
"""

import argparse
import asyncio
import os
import sys

from tokenizers import Tokenizer

parser = argparse.ArgumentParser()
parser.add_argument("--model-path", required=True)
args, _ = parser.parse_known_args(sys.argv[1:])
TOKENIZER = Tokenizer.from_file(args.model_path + "/tokenizer.json")

TURN = "<|im_start|>assistant\n"
NO_THINK = "<think>\n\n</think>\n\n"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
THINK = "<think>\nThe user wants the weather in Paris. I should call get_weather.\n</think>\n\n"
RESULT = '<tool_response>\n{"temperature": 18}\n</tool_response>'


def answer(prompt: str) -> str:
    thinking = not prompt.endswith(NO_THINK)
    think = THINK if thinking else ""
    if RESULT in prompt and CALL in prompt:
        return think.replace("I should call get_weather", "I have the result") + "It is 18 degrees in Paris."
    if RESULT in prompt:
        return "The earlier tool call is missing from the history."
    if "<tools>" in prompt:
        return think + "Let me check.\n" + CALL
    return "No tools here."


ARGS = '{"city": "Paris", "unit": "celsius"}'


def guided(schema):
    if schema.get("type") == "array":
        name = schema["items"]["anyOf"][0]["properties"]["name"]["enum"][0]
        return '[{"name": "%s", "parameters": %s}]' % (name, ARGS)
    return ARGS


DELAY = float(os.environ.get("TOOL_ENGINE_DELAY_S", "0"))  # seconds per token (for kill tests)


async def generate(request):
    ids = request["token_ids"]
    prompt = TOKENIZER.decode(ids, skip_special_tokens=False)
    cut = prompt.rfind(TURN) + len(TURN)  # the prompt as templated, without what a dead worker wrote
    prompt = prompt[:cut] + (NO_THINK if prompt[cut:].startswith(NO_THINK) else "")
    constraint = request["sampling_options"]["guided_decoding"]
    text = guided(constraint["json"]) if constraint else answer(prompt)
    out = TOKENIZER.encode(text, add_special_tokens=False).ids
    # a migrated request ends with what another worker already wrote: go on from there, as a model would
    done = next((k for k in range(len(out), 0, -1) if ids[-k:] == out[:k]), 0)
    for tid in out[done:]:
        if DELAY:
            await asyncio.sleep(DELAY)
        yield {"token_ids": [tid]}
    yield {"token_ids": [], "finish_reason": "stop"}


generate.guided_decoding = True
