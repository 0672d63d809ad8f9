"""LoRA adapters of ``out=llamacpp``: loading, checking, applying and freeing them.

llama.cpp applies adapters to a *context*, not to a sequence (``llama_set_adapters_lora``): every token
of one ``llama_decode`` runs with the same adapters.  So the scheduler (scheduler.py) runs one adapter
group per step, the base model being a group of its own, taking the groups in turn when several have
work; llama-server does the same (it batches only slots whose LoRA settings are equal).  Requests of one
adapter still batch together.  A slot's cache is tagged with the adapter it was computed under
(``Slot.lora_uid``), and a prompt reuses only a cache of its own adapter (slots.py).

Checks before llama.cpp sees a file, because llama.cpp only logs why it refuses one (and its log is
off): the file exists and is a GGUF, ``general.type`` is ``adapter`` and ``adapter.type`` is ``lora``, and
its architecture is the model's.  F32 adapters are served as llama-server serves them: the crash once
blamed on them was the native build's AMX kernels (GCC 12 miscompiles their tile configuration; any long
enough prompt dies there, adapter or not), which setup no longer builds and the engine's preflight
catches.  What llama.cpp still refuses (tensors of the wrong shape: an adapter of another model of the
same architecture) is reported as that.

Unloading: the name stops being served at once; the adapter's weights are freed once no running or
waiting request uses it (those finish with it), and the slots it computed are emptied then.  Every
method that touches llama.cpp runs on the scheduler thread.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dynamo.engines.llamacpp.model import Llama
from dynamo.errors import UserError

log = logging.getLogger(__name__)

_uids = itertools.count(1)  # 0 is the base model


@dataclass(eq=False)
class Adapter:
    name: str
    path: Path
    handle: Any  # llama_adapter_lora *
    uid: int  # tags slot caches: a reloaded name is another adapter
    retired: bool = False  # unloaded: freed once no request uses it


def check_adapter_file(path: Path, model_arch: str) -> None:
    """A UserError saying what is wrong with ``path`` as a LoRA adapter of a ``model_arch`` model."""
    if not path.is_file():
        raise UserError(f"LoRA adapter {path}: no such file")
    try:
        import gguf

        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - gguf raises ValueError, struct.error, OSError... for a bad file
        raise UserError(f"LoRA adapter {path}: not a GGUF file ({e})") from None

    def field(key: str) -> Any:
        f = reader.fields.get(key)
        return f.contents() if f is not None else None

    kind = field("general.type")
    if kind != "adapter":
        raise UserError(f"LoRA adapter {path}: not an adapter (general.type is {kind!r}, not 'adapter'); "
                        "convert a LoRA with llama.cpp's convert_lora_to_gguf.py")
    if field("adapter.type") != "lora":
        raise UserError(f"LoRA adapter {path}: adapter.type is {field('adapter.type')!r}, not 'lora'")
    arch = field("general.architecture")
    if arch != model_arch:
        raise UserError(f"LoRA adapter {path}: made for the {arch!r} architecture, the model is {model_arch!r}")


def model_arch(llama: Llama) -> str:
    buf = ctypes.create_string_buffer(256)
    n = llama.L.llama_model_meta_val_str(llama.model, b"general.architecture", buf, len(buf))
    return buf.value.decode("utf-8", "replace") if n >= 0 else ""


def load_adapter(llama: Llama, name: str, path: Path) -> Adapter:
    """Check and load ``path`` for the loaded model (UserError: it is not an adapter of it)."""
    check_adapter_file(path, model_arch(llama))
    handle = llama.L.llama_adapter_lora_init(llama.model, str(path).encode())
    if not handle:
        raise UserError(f"LoRA adapter {path}: llama.cpp refused it: its tensors do not fit this model "
                        "(an adapter of another model?)")
    adapter = Adapter(name, path, handle, next(_uids))
    log.info("LoRA adapter %s loaded from %s", name, path)
    return adapter


class AppliedAdapters:
    """Which adapter the context decodes with now; switching costs one llama.cpp call (no recompute)."""

    def __init__(self) -> None:
        self.current: Adapter | None = None
        self.switches = 0

    def apply(self, llama: Llama, adapter: Adapter | None) -> None:
        if adapter is self.current:
            return
        L = llama.L
        if adapter is None:
            rc = L.llama_set_adapters_lora(llama.lctx, None, 0, None)
        else:
            handles = (L.llama_adapter_lora_p_ctypes * 1)(adapter.handle)
            scales = (ctypes.c_float * 1)(1.0)
            rc = L.llama_set_adapters_lora(llama.lctx, handles, 1, scales)
        if rc != 0:
            raise RuntimeError(f"llama_set_adapters_lora failed ({rc})")
        self.current = adapter
        self.switches += 1

    def free(self, llama: Llama, adapter: Adapter) -> None:
        """Free an adapter no request uses (the base model is applied first if it was current)."""
        if self.current is adapter:
            self.apply(llama, None)
        llama.L.llama_adapter_lora_free(adapter.handle)
        log.info("LoRA adapter %s unloaded", adapter.name)
