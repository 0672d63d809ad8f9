"""Model card from a GGUF file alone: tokenizer, chat template, stop ids, context length.

The GGUF vocabulary is rebuilt as a Hugging Face ``tokenizers`` tokenizer, so a lone .gguf file works
with our pre-processor and its card can travel to a remote frontend like any other.  Byte-level BPE
vocabularies (``gpt2``: Llama 3, Qwen, SmolLM, ...) and SentencePiece BPE (``llama``: Llama 2, Mistral,
TinyLlama) are supported; for anything else pass ``--model-config <hf folder>``.
"""

from __future__ import annotations

import json
import logging
import mmap
import struct
from pathlib import Path
from typing import Any

from dynamo.errors import ModelError
from dynamo.llm.model_card import ModelCard

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"

# llama.cpp token types
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# pre-tokenizer regexes by llama.cpp's ``tokenizer.ggml.pre`` name (the ones HF models ship with)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def is_gguf(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def read_metadata(path: Path) -> dict[str, Any]:
    """All key/value metadata of a GGUF file, after checking the file is whole.

    Our own bounded parser rather than ``gguf.GGUFReader``: every length and count is checked against
    the file size before anything is read or allocated, so a corrupt file fails at once with a message
    saying what is wrong (GGUFReader may raise odd exceptions, or try to allocate absurd arrays), and a
    truncated file (an interrupted download) is caught here rather than deep inside an engine.
    """
    if not is_gguf(path):
        raise ModelError(f"{path}: not a GGUF file (bad magic); expected a .gguf model or a model folder")
    try:
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _GGUFParser(data).parse(path)
    except ModelError:
        raise
    except RecursionError:
        raise ModelError(f"{path}: corrupt GGUF file: arrays nested too deeply") from None
    except (OSError, ValueError) as e:
        raise ModelError(f"{path}: cannot read GGUF file ({e})") from None


class _Corrupt(Exception):
    pass


# GGUF value types -> struct format (scalars)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_MAX_COUNT = 1 << 32  # no real file has more keys, tensors or array items than this


class _GGUFParser:
    def __init__(self, data: Any):
        self.data = data
        self.size = len(data)
        self.pos = 4
        self.endian = "<"

    def _take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > self.size:
            raise _Corrupt(f"needs {n} bytes at offset {self.pos} but the file has {self.size}")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def _scalar(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        return struct.unpack(self.endian + fmt, self._take(size))[0]

    def _count(self, what: str) -> int:
        n = self._scalar("Q")
        if n > _MAX_COUNT or n > self.size:
            raise _Corrupt(f"implausible {what} count {n}")
        return n

    def _string(self) -> str:
        n = self._scalar("Q")
        if n > self.size - self.pos:
            raise _Corrupt(f"a string of {n} bytes at offset {self.pos - 8} runs past the end of the file")
        return self._take(n).decode("utf-8", errors="replace")

    def _value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self._scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            etype = self._scalar("I")
            n = self._count("array item")
            if etype in _SCALARS:
                fmt = _SCALARS[etype]
                raw = self._take(n * struct.calcsize(fmt))
                return list(struct.unpack(f"{self.endian}{n}{fmt}", raw))
            if etype == _STRING:
                return [self._string() for _ in range(n)]
            if etype == _ARRAY:
                return [self._value(_ARRAY) for _ in range(n)]
            raise _Corrupt(f"unknown array item type {etype}")
        raise _Corrupt(f"unknown value type {vtype}")

    def parse(self, path: Path) -> dict[str, Any]:
        try:
            version = self._scalar("I")
            if version not in (2, 3):
                swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
                if swapped in (2, 3):
                    self.endian, version = ">", swapped
                else:
                    raise ModelError(f"{path}: corrupt GGUF file: unsupported GGUF version {version} "
                                     "(expected 2 or 3)")
            n_tensors = self._count("tensor")
            n_kv = self._count("metadata key")
            meta: dict[str, Any] = {}
            for _ in range(n_kv):
                key = self._string()
                meta[key] = self._value(self._scalar("I"))
            tensors = []
            for _ in range(n_tensors):
                name = self._string()
                n_dims = self._scalar("I")
                if n_dims > 8:
                    raise _Corrupt(f"tensor {name!r} has {n_dims} dimensions")
                dims = [self._scalar("Q") for _ in range(n_dims)]
                ttype = self._scalar("I")
                offset = self._scalar("Q")
                tensors.append((name, dims, ttype, offset))
        except _Corrupt as e:
            raise ModelError(f"{path}: corrupt or truncated GGUF file: {e}") from None
        alignment = meta.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment <= 0:
            alignment = 32
        data_start = -(-self.pos // alignment) * alignment
        end = data_start
        for name, dims, ttype, offset in tensors:
            end = max(end, data_start + offset + _tensor_bytes(path, name, dims, ttype))
        if end > self.size:
            raise ModelError(
                f"{path}: truncated GGUF file: its tensors need {end} bytes but the file has {self.size} "
                "(an interrupted download or copy?)"
            )
        return meta


# ggml tensor types: id -> (elements per block, bytes per block), as ggml defines them.  Our own table
# rather than the ``gguf`` package's so that reading a card needs neither gguf nor numpy.
_GGML_BLOCKS: dict[int, tuple[int, int]] = {
    0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 9: (32, 40),
    10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210), 15: (256, 292),
    16: (256, 66), 17: (256, 74), 18: (256, 98), 19: (256, 50), 20: (32, 18), 21: (256, 110), 22: (256, 82),
    23: (256, 136), 24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8), 29: (256, 56), 30: (1, 2),
    34: (256, 54), 35: (256, 66), 39: (32, 17), 40: (64, 36), 41: (128, 18),
}


def _tensor_bytes(path: Path, name: str, dims: list[int], ttype: int) -> int:
    try:
        block, type_size = _GGML_BLOCKS[ttype]
    except KeyError:
        raise ModelError(f"{path}: tensor {name!r} has an unknown data type {ttype} (corrupt file, or a newer "
                         "GGUF type than this version knows)") from None
    n = 1
    for d in dims:
        n *= d
    return n // block * type_size


def load_gguf(path: Path, *, name: str | None = None, need_tokenizer: bool = True) -> ModelCard:
    """Card from a GGUF file.  ``need_tokenizer=False`` (``--model-config`` gives the tokenizer) lets a
    vocabulary type we cannot convert pass instead of failing."""
    path = path.resolve()
    meta = read_metadata(path)
    try:
        return _card(meta, path, name, need_tokenizer)
    except ModelError:
        raise
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
        raise ModelError(f"{path}: corrupt GGUF metadata ({type(e).__name__}: {e})") from None


def _card(meta: dict[str, Any], path: Path, name: str | None, need_tokenizer: bool) -> ModelCard:
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or not arch.strip():
        raise ModelError(f"{path}: GGUF file has no general.architecture (not a model file?)")
    tokens = meta.get("tokenizer.ggml.tokens")
    tokenizer_json = None
    if isinstance(tokens, list) and tokens:
        try:
            tokenizer_json = build_tokenizer_json(meta, path)
        except ModelError:
            if need_tokenizer:
                raise
            log.info("GGUF vocabulary not converted; the tokenizer comes from --model-config")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    eos_ids = [int(eos)] if isinstance(eos, int) else []
    eot = meta.get("tokenizer.ggml.eot_token_id")
    if isinstance(eot, int) and eot not in eos_ids:
        eos_ids.append(int(eot))
    bos = meta.get("tokenizer.ggml.bos_token_id")
    special: dict[str, Any] = {}
    if isinstance(tokens, list):
        for key, tid in (("bos_token", bos), ("eos_token", eos), ("unk_token", meta.get("tokenizer.ggml.unknown_token_id"))):
            if isinstance(tid, int) and 0 <= tid < len(tokens):
                special[key] = tokens[tid]
    template = meta.get("tokenizer.chat_template")
    context_length = meta.get(f"{arch}.context_length") or 0
    if not isinstance(context_length, int) or context_length < 0:
        raise ModelError(f"{path}: corrupt GGUF metadata: {arch}.context_length is {context_length!r}")
    return ModelCard(
        display_name=name or path.stem,
        path=path,
        config={"architectures": [arch.capitalize() + "ForCausalLM"], "model_type": arch,
                "gguf": {k: v for k, v in meta.items() if k.startswith(arch + ".")}},
        tokenizer_json=tokenizer_json,
        tokenizer_config=special,
        chat_template=template if isinstance(template, str) else None,
        context_length=context_length,
        eos_token_ids=eos_ids,
        bos_token_id=int(bos) if isinstance(bos, int) else None,
        gguf_path=path,
    )


def build_tokenizer_json(meta: dict[str, Any], path: Path) -> str:
    kind = meta.get("tokenizer.ggml.model")
    for key, typ in (("tokenizer.ggml.tokens", str), ("tokenizer.ggml.merges", str),
                     ("tokenizer.ggml.token_type", int), ("tokenizer.ggml.scores", (int, float))):
        value = meta.get(key)
        if value is not None and not (isinstance(value, list) and all(isinstance(v, typ) for v in value)):
            raise ModelError(f"{path}: corrupt GGUF metadata: {key} is not a list of {getattr(typ, '__name__', 'numbers')}")
    if kind == "gpt2":
        return _byte_level_bpe(meta)
    if kind == "llama":
        return _sentencepiece_bpe(meta)
    raise ModelError(
        f"{path}: GGUF tokenizer type {kind!r} cannot be converted; pass --model-config <hf folder> "
        "with the model's tokenizer.json"
    )


def _added_tokens(tokens: list[str], types: list[int] | None) -> list[dict[str, Any]]:
    out = []
    for i, tok in enumerate(tokens):
        t = types[i] if types and i < len(types) else _NORMAL
        if t in (_CONTROL, _USER_DEFINED, _UNKNOWN):
            out.append({"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
                        "normalized": t == _USER_DEFINED and False, "special": t != _USER_DEFINED or tok.startswith("<")})
    return out


def _byte_level_bpe(meta: dict[str, Any]) -> str:
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = meta.get("tokenizer.ggml.merges") or []
    pre = meta.get("tokenizer.ggml.pre", "default")
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    if pre in ("llama-bpe", "llama3", "falcon3", "dbrx", "smaug-bpe", "tekken"):
        pre_tok: dict[str, Any] = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": _LLAMA3_SPLIT}, "behavior": "Isolated", "invert": False},
            dict(byte_level, use_regex=False)]}
    elif pre in ("qwen2", "deepseek-r1-qwen"):
        pre_tok = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": _QWEN2_SPLIT}, "behavior": "Isolated", "invert": False},
            dict(byte_level, use_regex=False)]}
    elif pre == "smollm" or pre == "starcoder" or pre == "refact":
        pre_tok = {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True}, byte_level]}
    else:
        if pre not in ("default", "gpt-2", "gpt2"):
            log.warning("GGUF pre-tokenizer %r is not known; using GPT-2 rules (tokenization may differ slightly)", pre)
        pre_tok = byte_level
    data = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": _added_tokens(tokens, meta.get("tokenizer.ggml.token_type")),
        "normalizer": None,
        "pre_tokenizer": pre_tok,
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {tok: i for i, tok in enumerate(tokens)},
                  "merges": [m if isinstance(m, str) else " ".join(m) for m in merges]},
    }
    return json.dumps(data, ensure_ascii=False)


def _sentencepiece_bpe(meta: dict[str, Any]) -> str:
    """SentencePiece BPE (Llama 2 style) as HF's fast tokenizer does it: merges ranked by piece score."""
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    scores: list[float] = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    types = meta.get("tokenizer.ggml.token_type")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    ranked = []
    for tok, i in vocab.items():
        if types and types[i] != _NORMAL:
            continue
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], vocab[left], vocab[right], left, right))
    ranked.sort()
    merges = [f"{left} {right}" for *_, left, right in ranked]
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    add_space = meta.get("tokenizer.ggml.add_space_prefix", True)
    data = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": _added_tokens(tokens, types),
        "normalizer": None,
        "pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581",
                          "prepend_scheme": "first" if add_space else "never", "split": False},
        "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            *([{"type": "Strip", "content": " ", "start": 1, "stop": 0}] if add_space else [])]},
        "model": {"type": "BPE", "dropout": None,
                  "unk_token": tokens[unk] if isinstance(unk, int) and 0 <= unk < len(tokens) else None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": True,
                  "byte_fallback": True, "ignore_merges": False, "vocab": vocab, "merges": merges},
    }
    return json.dumps(data, ensure_ascii=False)
