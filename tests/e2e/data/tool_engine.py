"""Test engine (pytok): answers as Qwen3 does in a tool loop, with real token ids of the served model.

First turn (the prompt lists tools): reasoning in <think>, a sentence, then one <tool_call>.  Once the
prompt holds our call and its <tool_response>, the final answer.  With thinking turned off (the template
closed an empty think block) no reasoning is written.  A prompt with no tools gets a plain answer.
Under guided decoding (tool_choice required / a named function) it writes the JSON the schema asks for:
an array of calls, or the arguments object; it says it honours guided decoding (the attribute below).
"""

import argparse
import sys

from tokenizers import Tokenizer

parser = argparse.ArgumentParser()
parser.add_argument("--model-path", required=True)
args, _ = parser.parse_known_args(sys.argv[1:])
TOKENIZER = Tokenizer.from_file(args.model_path + "/tokenizer.json")

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
THINK = "<think>\nThe user wants the weather in Paris. I should call get_weather.\n</think>\n\n"
RESULT = '<tool_response>\n{"temperature": 18}\n</tool_response>'


def answer(prompt: str) -> str:
    thinking = not prompt.endswith("<think>\n\n</think>\n\n")
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


async def generate(request):
    prompt = TOKENIZER.decode(request["token_ids"], skip_special_tokens=False)
    constraint = request["sampling_options"]["guided_decoding"]
    text = guided(constraint["json"]) if constraint else answer(prompt)
    for tid in TOKENIZER.encode(text, add_special_tokens=False).ids:
        yield {"token_ids": [tid]}
    yield {"token_ids": [], "finish_reason": "stop"}


generate.guided_decoding = True
