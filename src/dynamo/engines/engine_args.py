"""``--extra-engine-args FILE``: the one place that reads it.

vLLM, SGLang, llama.cpp, mistral.rs and the mocker take a JSON object; TensorRT-LLM takes its own YAML
file, which it reads itself.  The command line checks the file once, at parse time, with
:func:`check_engine_args`, so a bad file is a one-line error before any model loads; the engines read it
with :func:`engine_args`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dynamo.errors import UserError
from dynamo.run_config import RunConfig

# engines whose --extra-engine-args is not JSON: they read the file themselves
NON_JSON_ENGINES = ("trtllm",)


def read_json_object(path: Path, label: str, *, missing: str) -> dict[str, Any]:
    """The JSON object in ``path``, whatever the file's name. A missing file is the :class:`UserError`
    ``missing``; bad JSON or another JSON value is one that starts with ``label`` (what the file is for)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(missing) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{label} {path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise UserError(f"{label} {path}: expected a JSON object")
    return data


def read_json_args(path: Path) -> dict[str, Any]:
    """The ``--extra-engine-args`` JSON object in ``path``."""
    return read_json_object(path, "--extra-engine-args", missing=f"--extra-engine-args: no such file: {path}")


def engine_args(cfg: RunConfig) -> dict[str, Any]:
    """``--extra-engine-args`` as a JSON object, or ``{}`` when the flag was not given."""
    return read_json_args(cfg.extra_engine_args) if cfg.extra_engine_args is not None else {}


def check_engine_args(cfg: RunConfig) -> None:
    """Fail early on a missing file, or on a JSON file that is not a JSON object (engines that read JSON)."""
    path = cfg.extra_engine_args
    if path is None:
        return
    if not path.is_file():
        raise UserError(f"--extra-engine-args: no such file: {path}")
    if path.suffix.lower() in (".json", "") and cfg.engine not in NON_JSON_ENGINES:
        read_json_args(path)
