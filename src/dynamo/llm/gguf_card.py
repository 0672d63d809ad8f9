"""Model card from a GGUF file alone (spec 2.3): tokenizer, chat template, stop ids, context length.

The GGUF vocabulary is rebuilt as a Hugging Face ``tokenizers`` tokenizer, so a lone .gguf file works
with our pre-processor and its card can travel to a remote frontend like any other.  Byte-level BPE
vocabularies (``gpt2``: Llama 3, Qwen, SmolLM, ...) and SentencePiece BPE (``llama``: Llama 2, Mistral,
TinyLlama) are supported; for anything else pass ``--model-config <hf folder>``.
"""

from __future__ import annotations

import json
import logging
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
    """All key/value metadata of a GGUF file (tensors are not read)."""
    if not is_gguf(path):
        raise ModelError(f"{path}: not a GGUF file (bad magic); expected a .gguf model or a model folder")
    try:
        import gguf

        reader = gguf.GGUFReader(str(path))
        meta = {}
        for key, fld in reader.fields.items():
            try:
                meta[key] = fld.contents()
            except Exception:  # a field type the reader cannot render: we do not need it
                continue
        return meta
    except ModelError:
        raise
    except Exception as e:
        raise ModelError(f"{path}: corrupt or truncated GGUF file ({type(e).__name__}: {e})") from None


def load_gguf(path: Path, *, name: str | None = None) -> ModelCard:
    path = path.resolve()
    meta = read_metadata(path)
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelError(f"{path}: GGUF file has no general.architecture")
    tokens = meta.get("tokenizer.ggml.tokens")
    tokenizer_json = None
    if isinstance(tokens, list) and tokens:
        tokenizer_json = build_tokenizer_json(meta, path)
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
    return ModelCard(
        display_name=name or path.stem,
        path=path,
        config={"architectures": [arch.capitalize() + "ForCausalLM"], "model_type": arch,
                "gguf": {k: v for k, v in meta.items() if k.startswith(arch + ".")}},
        tokenizer_json=tokenizer_json,
        tokenizer_config=special,
        chat_template=meta.get("tokenizer.chat_template"),
        context_length=int(meta.get(f"{arch}.context_length") or 0),
        eos_token_ids=eos_ids,
        bos_token_id=int(bos) if isinstance(bos, int) else None,
        gguf_path=path,
    )


def build_tokenizer_json(meta: dict[str, Any], path: Path) -> str:
    kind = meta.get("tokenizer.ggml.model")
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
