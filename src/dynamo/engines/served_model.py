"""A served model from the command line's choices: pick the engine, build it, start it, wrap it in the
pipeline its kind needs; and close it again.  The local inputs and the worker both serve what this builds.
"""

from __future__ import annotations

import logging
from typing import cast

from dynamo.engines.registry import OPTIONAL_PACKAGES, create_engine, engine_installed
from dynamo.errors import UserError
from dynamo.llm.constraints import engine_guided_kinds
from dynamo.llm.engine import Engine, ServesLoraAdapters, capabilities_of, start_engine
from dynamo.llm.lora import check_adapter_name
from dynamo.llm.model_card import ModelCard
from dynamo.llm.pipeline import CorePipeline, FullPipeline, ServedModel
from dynamo.run_config import RunConfig

log = logging.getLogger(__name__)

# the order we try engines in when out= is not given (best first for each kind of model)
GGUF_ENGINE_ORDER = ("llamacpp", "mistralrs")
FOLDER_ENGINE_ORDER = ("vllm", "mistralrs")


def choose_engine(cfg: RunConfig, card: ModelCard) -> str:
    if cfg.engine is not None:
        return cfg.engine
    if cfg.model is None:
        raise UserError(
            "no model given: pass a model (Hugging Face repo id, folder or GGUF file), "
            "or out=echo_full to try the server without one"
        )
    order = GGUF_ENGINE_ORDER if card.gguf_path is not None else FOLDER_ENGINE_ORDER
    for name in order:
        if engine_installed(name):
            log.info("Using default engine: %s. Use out=<engine> to choose another.", name)
            return name
    kind = "a GGUF file" if card.gguf_path is not None else "a Hugging Face folder"
    installs = "; ".join(f"out={name}: pip install {OPTIONAL_PACKAGES[name][1]}" for name in order)
    raise UserError(
        f"no engine installed that can serve {kind}. Install one ({installs}), "
        "or pass out=echo_core to test the pipeline"
    )


async def build_served_model(cfg: RunConfig, card: ModelCard, engine_name: str) -> ServedModel:
    """Build, start and wrap the engine: an embedding model, a core (token) pipeline or a full one."""
    if cfg.loras and cfg.embedding:
        raise UserError("--lora: an embedding model (--embedding) serves no LoRA adapters")
    if cfg.mmproj and (cfg.embedding or engine_name != "llamacpp"):
        raise UserError("--mmproj: only out=llamacpp loads an image projector, and not for --embedding")
    created = create_engine(engine_name, cfg, card)
    if cfg.embedding:
        from dynamo.llm.embeddings import EmbeddingEngine, EmbeddingModel

        await start_engine(created)
        return EmbeddingModel(card.display_name, card, cast(EmbeddingEngine, created))
    engine = cast(Engine, created)
    if cfg.chat_template is not None and engine.kind != "core":
        raise UserError(f"--chat-template: out={engine_name} applies its own template; the flag works with "
                        "engines that take tokens (llamacpp, vllm, sglang, trtllm, echo_core, pytok:, mocker)")
    if cfg.loras and not isinstance(engine, ServesLoraAdapters):
        raise UserError(f"--lora: out={engine_name} does not serve LoRA adapters (out=llamacpp and out=vllm do)")
    await start_engine(engine)
    name = card.display_name
    for lora_name, path in cfg.loras:  # a bad adapter stops the start with its one-line error
        if isinstance(engine, ServesLoraAdapters):
            await engine.load_lora(check_adapter_name(lora_name, name), path)
    caps = capabilities_of(engine)
    if engine.kind == "core":
        card.guided_decoding = engine_guided_kinds(caps.guided_decoding)
        card.logit_bias = caps.logit_bias
        card.logprobs = caps.logprobs
        card.prompt_logprobs = caps.prompt_logprobs
        card.image_tokens = caps.image_tokens
        return CorePipeline(name, card, engine)
    for flag, value in (("--tool-call-parser", cfg.tool_call_parser), ("--reasoning-parser", cfg.reasoning_parser)):
        if value not in (None, "auto", "none"):
            raise UserError(f"{flag} works with token engines; out={engine_name} reads the OpenAI request and "
                            "writes the answer itself, so parsing is its own")
    card.image_urls = caps.image_urls
    tokenizer = None
    if card.has_tokenizer:
        from dynamo.llm.tokenizer import Tokenizer

        tokenizer = Tokenizer(card.tokenizer_json)  # type: ignore[arg-type]
    return FullPipeline(name, card, engine, tokenizer)
