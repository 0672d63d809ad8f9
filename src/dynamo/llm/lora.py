"""LoRA adapters served as models of their own: one base model, many fine-tunes, each a model name.

An engine that serves adapters (``ServesLoraAdapters`` in llm/engine.py: llama.cpp, vLLM) runs a request with
the adapter its ``model`` names; everything else about the request (template, tokenizer, stop tokens) is
the base model's.  So an adapter is served by a pipeline over the *same* engine whose card is the base
card under the adapter's name, with ``lora`` saying what it is (Dynamo's card field: ``name``; ours:
``base_model``, the parent's served name, and ``path``).  ``/v1/models`` lists it with ``parent`` and
``root`` as vLLM does; a worker publishes its card as a model entry of its own, so frontends route the
adapter's requests only to the workers that have it.
"""

from __future__ import annotations

import dataclasses
import os
import re

from dynamo.errors import UserError
from dynamo.llm.engine import ServesLoraAdapters
from dynamo.llm.model_card import ModelCard
from dynamo.llm.pipeline import CorePipeline, ServedModel

# run-time loading (HTTP routes, a worker's load_lora endpoint): the operator's decision, off by default
RUNTIME_LORA_ENV = ("DYN_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING")


def runtime_lora_allowed() -> bool:
    """Whether this process loads and unloads adapters at run time (loading reads any file it can read)."""
    return any(os.environ.get(name, "").strip().lower() in ("1", "true", "yes") for name in RUNTIME_LORA_ENV)


# a worker's control endpoints beside ``generate`` (Dynamo's names; worker/lora_control.py), and the key of
# its runtime_config that says it serves adapters (present) and loads them at run time (true)
LOAD_LORA_ENDPOINT = "load_lora"
UNLOAD_LORA_ENDPOINT = "unload_lora"
LIST_LORAS_ENDPOINT = "list_loras"
RUNTIME_LORA_KEY = "runtime_lora_updating"


# what vLLM accepts in --lora-modules name=path; a name must not look like a path or carry spaces
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")


def check_adapter_name(name: str, base_name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise UserError(f"LoRA adapter name {name!r}: use letters, digits and . _ : / - (at most 128)")
    if name == base_name:
        raise UserError(f"LoRA adapter name {name!r} is the base model's name")
    return name


def adapter_card(base: ModelCard, name: str, path: str) -> ModelCard:
    """The base card, served as the adapter ``name``."""
    card = dataclasses.replace(base, display_name=name)
    card.lora = {"name": name, "base_model": base.display_name, "path": path}
    return card


def adapter_model(base: ServedModel, name: str, path: str) -> ServedModel:
    """A served model for the adapter ``name`` of ``base`` (a token pipeline over the same engine)."""
    if not isinstance(base, CorePipeline):
        raise UserError(f"model {base.name!r} cannot serve LoRA adapters (its engine reads OpenAI requests)")
    return CorePipeline(name, adapter_card(base.card, name, path), base.engine)


def served_adapters(base: ServedModel) -> list[ServedModel]:
    """The served models of the adapters ``base``'s engine has loaded (none if it serves no adapters)."""
    engine = base.engine
    if not isinstance(engine, ServesLoraAdapters):
        return []
    return [adapter_model(base, name, path) for name, path in engine.lora_adapters().items()]
