"""LoRA adapters of ``out=vllm``: vLLM's own multi-LoRA (``enable_lora``, a ``LoRARequest`` per request).

An adapter is a PEFT folder (``adapter_config.json`` and ``adapter_model.safetensors``, or PEFT's older
``adapter_model.bin``), as vLLM's ``--lora-modules name=path`` takes.  vLLM batches requests of different
adapters and of the base model in one step (up to ``max_loras`` adapters per batch), and keys its prefix
cache by the adapter's name, so an adapter's blocks never match the base model's; its KV events name the
adapter (``lora_name``), and kv/zmq_events.py hashes those blocks under the adapter's salt.

Engine arguments: LoRA is on when adapters are given at start (``--lora``) or run-time loading is allowed
(``DYN_ALLOW_RUNTIME_LORA_UPDATING``): ``enable_lora=True``, ``max_loras`` 4 (vLLM's default is 1: one
adapter per batch), ``max_lora_rank`` the smallest rank vLLM offers that holds every start adapter's ``r``,
at least vLLM's default 16.  ``--extra-engine-args`` wins over each (e.g. ``{"max_lora_rank": 64}`` for
larger adapters loaded later).  vLLM reserves LoRA buffers for ``max_loras`` adapters of ``max_lora_rank``.

Loading: the folder is checked here first (it exists, its config is a PEFT LoRA, the weights are there, its
rank fits ``max_lora_rank``) because vLLM reports these from its worker process with a traceback in its
log; what only vLLM can tell (tensors of another model's shapes) comes back from ``AsyncLLM.add_lora`` as
one line.  A load that failed is removed from vLLM's adapter cache again, since vLLM keeps a half-loaded
adapter there.  Each load gets a fresh ``lora_int_id``, so a name loaded again is a new adapter to vLLM
(and its cached blocks, keyed by the name, are the old ones' only if the weights are the same: reload
changed weights under a new name).

Unloading: the name stops being served at once and vLLM drops the adapter from its cache; a request already
running with it goes on (vLLM reloads an adapter a running request names from its path).
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from dynamo.engines.engine_args import read_json_object
from dynamo.engines.token_engine_common import one_line
from dynamo.errors import EngineError, UserError

# the ranks vLLM's LoRAConfig accepts for max_lora_rank (its MaxLoRARanks)
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
DEFAULT_MAX_LORA_RANK = 16
DEFAULT_MAX_LORAS = 4
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")


def adapter_rank(path: Path) -> int:
    """The rank ``r`` of the PEFT LoRA adapter folder ``path`` (UserError saying what is wrong with it)."""
    if path.is_file():
        raise UserError(f"LoRA adapter {path}: out=vllm takes a PEFT adapter folder (adapter_config.json and "
                        "adapter_model.safetensors), not a file")
    if not path.is_dir():
        raise UserError(f"LoRA adapter {path}: no such folder")
    config_file = path / "adapter_config.json"
    config = read_json_object(config_file, "LoRA adapter",
                              missing=f"LoRA adapter {path}: no adapter_config.json (not a PEFT adapter folder)")
    kind = config.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise UserError(f"LoRA adapter {path}: peft_type is {kind!r}, not 'LORA'")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise UserError(f"LoRA adapter {config_file}: 'r' (the rank) must be a positive integer, not {rank!r}")
    if not any((path / name).is_file() for name in WEIGHT_FILES):
        raise UserError(f"LoRA adapter {path}: no adapter_model.safetensors (nor adapter_model.bin)")
    return rank


def lora_engine_args(paths: Iterable[str], *, runtime: bool,
                     extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``AsyncEngineArgs`` keyword arguments for LoRA (see the module docstring); empty when neither
    start-time adapters nor run-time loading are asked for.  A bad start adapter is its UserError here,
    before vLLM starts."""
    ranks = [adapter_rank(Path(p)) for p in paths]
    if not ranks and not runtime:
        return {}
    extra = extra or {}
    if extra.get("enable_lora") is False:
        raise UserError("--extra-engine-args sets enable_lora to false, but LoRA adapters are asked for "
                        "(--lora or DYN_ALLOW_RUNTIME_LORA_UPDATING)")
    need = max(ranks, default=DEFAULT_MAX_LORA_RANK)
    rank = next((r for r in VLLM_MAX_LORA_RANKS if r >= max(need, DEFAULT_MAX_LORA_RANK)), None)
    if rank is None:
        raise UserError(f"LoRA adapter rank {need}: vLLM serves ranks up to {VLLM_MAX_LORA_RANKS[-1]}")
    return {"enable_lora": True, "max_loras": DEFAULT_MAX_LORAS, "max_lora_rank": rank}


_WORKER_ERROR = re.compile(r"Worker failed with error '(.*)', please check", re.S)


def vllm_load_error(e: BaseException) -> str:
    """vLLM's one-line reason for a failed ``add_lora`` (its engine core wraps the worker's error)."""
    found = _WORKER_ERROR.search(str(e))
    return one_line(Exception(found.group(1))) if found else one_line(e)


@dataclass(frozen=True)
class LoadedAdapter:
    name: str
    path: str
    lora_id: int  # vLLM's lora_int_id: unique per load


class VllmAdapters:
    """The adapters an ``AsyncLLM`` serves, by name; :meth:`request` is the ``LoRARequest`` for a name."""

    def __init__(self) -> None:
        self.adapters: dict[str, LoadedAdapter] = {}
        self.unloaded: set[str] = set()  # names unloaded: a request still naming one is an error
        self._ids = itertools.count(1)  # vLLM's ids start at 1
        self.max_rank = 0  # vLLM's max_lora_rank once started (0: LoRA is off)

    def adopt(self, vllm_config: Any) -> None:
        lora = getattr(vllm_config, "lora_config", None)
        self.max_rank = int(getattr(lora, "max_lora_rank", 0) or 0) if lora is not None else 0

    async def load(self, llm: Any, name: str, path: str) -> None:
        from vllm.lora.request import LoRARequest

        if not self.max_rank:
            raise UserError("out=vllm was started without LoRA: give adapters with --lora at start, or set "
                            "DYN_ALLOW_RUNTIME_LORA_UPDATING=true before starting it")
        if name in self.adapters:
            raise UserError(f"LoRA adapter {name!r} is already loaded")
        rank = adapter_rank(Path(path))
        if rank > self.max_rank:
            raise UserError(f"LoRA adapter {path}: rank {rank} is over this server's max_lora_rank "
                            f"{self.max_rank} (start it with a larger max_lora_rank in --extra-engine-args)")
        adapter = LoadedAdapter(name, str(path), next(self._ids))
        try:
            await llm.add_lora(LoRARequest(lora_name=name, lora_int_id=adapter.lora_id, lora_path=str(path)))
        except Exception as e:  # noqa: BLE001 - vLLM re-raises its worker's error as a bare Exception
            await self._forget(llm, adapter.lora_id)
            raise UserError(f"LoRA adapter {path}: vLLM cannot load it: {vllm_load_error(e)}") from None
        self.adapters[name] = adapter
        self.unloaded.discard(name)

    async def unload(self, llm: Any, name: str) -> None:
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            raise UserError(f"LoRA adapter {name!r} is not loaded")
        self.unloaded.add(name)
        await self._forget(llm, adapter.lora_id)

    @staticmethod
    async def _forget(llm: Any, lora_id: int) -> None:
        try:
            await llm.remove_lora(lora_id)
        except Exception:  # noqa: BLE001 - not in vLLM's cache (evicted, or never got there): nothing to free
            pass

    def request(self, model: str | None) -> Any:
        """The ``LoRARequest`` for a request naming ``model`` (None: the base model)."""
        adapter = self.adapters.get(model) if model else None
        if adapter is None:
            if model and model in self.unloaded:
                raise EngineError(f"LoRA adapter {model!r} is not loaded on this worker")
            return None
        from vllm.lora.request import LoRARequest

        return LoRARequest(lora_name=adapter.name, lora_int_id=adapter.lora_id, lora_path=adapter.path)
