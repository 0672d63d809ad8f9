"""Build tiny but *real* model folders for tests, offline and in milliseconds.

Tests for a serving CLI need model directories that the real loaders accept
(an HF-style folder with ``tokenizer.json``/``config.json``/... and a GGUF
file), but Hugging Face is unreachable from the test machines and real
checkpoints are far too big.  This module therefore *builds* them:

* a byte-level BPE tokenizer trained with the ``tokenizers`` library on an
  embedded corpus (so multi-byte UTF-8, digits and punctuation are covered),
* a 2-layer, 64-wide Llama config and matching random ``model.safetensors``,
* a ChatML chat template with a default system prompt, tool rendering and
  ``raise_exception`` on unknown roles,
* the same model as a llama.cpp-compatible GGUF,
* and broken GGUF files for error-path tests.

Everything is deterministic: the same arguments give byte-identical files.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

__all__ = [
    "CORPUS",
    "DEFAULT_CHAT_TEMPLATE",
    "DEFAULT_SYSTEM_PROMPT",
    "SPECIAL_TOKENS",
    "ENDOFTEXT_ID",
    "IM_START_ID",
    "IM_END_ID",
    "MULTIBYTE_SAMPLES",
    "build_tiny_hf_model",
    "build_tiny_gguf",
    "write_corrupt_gguf",
    "write_truncated_gguf",
    "tiny_llama_config",
    "tiny_llama_weights",
    "hf_to_gguf_rope_permute",
    "render_chat_template",
]

# --------------------------------------------------------------------------
# Constants
# --------------------------------------------------------------------------

#: Special tokens, in id order: they are handed to the BPE trainer first so
#: they get ids 0, 1, 2 and always encode as one id each.
SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ENDOFTEXT_ID = 0
IM_START_ID = 1
IM_END_ID = 2

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."

#: Strings the tokenizer must round-trip exactly; they are also part of the
#: corpus so that some multi-byte sequences get merged into single tokens.
MULTIBYTE_SAMPLES: tuple[str, ...] = (
    "café",
    "naïve résumé",
    "日本語のテキスト",
    "emoji 🙂 and 🚀!",
    "Ünïcödé – “quotes” — ellipsis…",
    "Привет, мир! Γειά σου κόσμε.",
    "price: 42.50€ or £37, 100% sure",
)

#: A few KB of varied English (plus some other scripts).  Written for this
#: module; content is irrelevant beyond giving BPE something realistic.
CORPUS: str = "\n".join(
    [
        "The quick brown fox jumps over the lazy dog. The dog did not mind.",
        "Hello, world! How are you today? I am fine, thank you very much.",
        "Once upon a time, in a small village by the sea, there lived an old "
        "fisherman who told stories to anyone who would listen.",
        "She opened the window, looked at the rain, and decided to stay home "
        "with a good book and a cup of tea.",
        "Machine learning models predict the next token given the previous "
        "tokens. A tokenizer turns text into numbers and numbers into text.",
        "The server listens on port 8080 and answers requests in JSON format.",
        "Please write a short poem about the moon, the stars and the night sky.",
        "What is the capital of France? The capital of France is Paris.",
        "What is 2 + 2? It is 4. What is 12 * 12? It is 144.",
        "Count with me: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 20, 100, 1000.",
        "Dates like 2024-01-31 and times like 12:45:07 appear in many logs.",
        "Phone: +1 (555) 010-9999; e-mail: someone@example.com; id #A7-b3.",
        "def add(a, b):\n    return a + b\n\nprint(add(3, 4))  # prints 7",
        'for (int i = 0; i < n; ++i) { sum += x[i]; }  /* C-style loop */',
        '{"role": "user", "content": "Hi there!", "tokens": [1, 2, 3]}',
        "Punctuation test: a.b,c;d:e!f?g 'single' \"double\" (paren) [bracket] "
        "{brace} <angle> a/b a\\b a|b a-b a_b a~b a`b a^b a&b a*b a%b a$b a@b.",
        "Tabs\tand  double  spaces   and\nnew lines\n\nand blank lines.",
        "I ordered a café au lait and a croissant at the café near the station.",
        "A naïve approach works, but a smarter one is faster. Her résumé was "
        "impressive; the fiancée and the fiancé both agreed.",
        "Über alles, Straße, Fräulein, Mädchen, schön, Grüße aus München.",
        "El niño comió piñata; ¿dónde está la biblioteca? ¡Qué bueno!",
        "日本語のテキストも少し入れておきます。東京は日本の首都です。",
        "中文文本：你好，世界！今天天气很好。",
        "한국어 문장도 있습니다. 안녕하세요!",
        "Привет, мир! Как дела? Γειά σου κόσμε. Ελληνικά γράμματα.",
        "Emoji are fun 🙂 🙂 🙂 and rockets 🚀 fly high; hearts ❤️ and stars ⭐.",
        "Math symbols: α + β = γ, ∑ x² ≤ ∞, π ≈ 3.14159, √2 ≈ 1.41421.",
        "Currency: $5, €10, £20, ¥300; price: 42.50€ or £37, 100% sure.",
        "Typography: “quotes”, ‘single’, en–dash, em—dash, ellipsis… Ünïcödé.",
        "The assistant answered politely and the user said thank you.",
        "You are a helpful assistant. Answer the question as well as you can.",
        "In the morning the market was busy; by the evening it was quiet again.",
        "Rivers flow to the sea, clouds carry the water back to the mountains.",
        "He tried again and again until, at last, the door finally opened.",
        "Good morning! Good afternoon! Good evening! Good night!",
        "Yes. No. Maybe. Of course! Why not? Let's go.",
        "The numbers 3.14, 2.718, 1.618 and 0.577 are famous constants.",
        "ABCDEFGHIJKLMNOPQRSTUVWXYZ abcdefghijklmnopqrstuvwxyz 0123456789",
        *MULTIBYTE_SAMPLES,
    ]
)

#: ChatML with a default system prompt, optional tools and role validation.
#: Every tag strips the whitespace before it (``{%-``/``{{-``), so the output
#: is the same whether or not the renderer uses trim_blocks/lstrip_blocks.
DEFAULT_CHAT_TEMPLATE: str = (
    "{%- for message in messages %}\n"
    "    {%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}\n"
    "        {{- raise_exception('Unsupported message role: ' + message['role']) }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if messages and messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content'] %}\n"
    "    {%- set loop_messages = messages[1:] %}\n"
    "{%- else %}\n"
    f"    {{%- set system_message = '{DEFAULT_SYSTEM_PROMPT}' %}}\n"
    "    {%- set loop_messages = messages %}\n"
    "{%- endif %}\n"
    "{{- '<|im_start|>system\\n' + system_message }}\n"
    "{%- if tools %}\n"
    "    {{- '\\n\\n# Tools\\n\\nYou may call these functions:\\n<tools>\\n' }}\n"
    "    {{- tools | tojson }}\n"
    "    {{- '\\n</tools>\\n\\nTo call one, reply with <tool_call>"
    '{"name": <function-name>, "arguments": <args-json-object>}'
    "</tool_call>' }}\n"
    "{%- endif %}\n"
    "{{- '<|im_end|>\\n' }}\n"
    "{%- for message in loop_messages %}\n"
    "    {{- '<|im_start|>' + message['role'] + '\\n' }}\n"
    "    {%- if message['content'] is string %}\n"
    "        {{- message['content'] }}\n"
    "    {%- endif %}\n"
    "    {%- if message['tool_calls'] %}\n"
    "        {%- for tool_call in message['tool_calls'] %}\n"
    "            {%- set call = tool_call['function'] if tool_call['function'] is defined else tool_call %}\n"
    # tojson is output on its own: jinja2's tojson returns Markup, and
    # `'<tool_call>' + Markup` would HTML-escape the literal string.
    "            {{- '<tool_call>{\"name\": ' }}{{- call['name'] | tojson }}{{- ', \"arguments\": ' }}\n"
    "            {%- if call['arguments'] is string %}\n"
    "                {{- call['arguments'] }}\n"
    "            {%- else %}\n"
    "                {{- call['arguments'] | tojson }}\n"
    "            {%- endif %}\n"
    "            {{- '}</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "    {%- endif %}\n"
    "    {{- '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}"
)

# Tiny Llama shape (see build_tiny_hf_model's docstring).
_HIDDEN = 64
_INTERMEDIATE = 128
_LAYERS = 2
_HEADS = 2
_KV_HEADS = 2
_HEAD_DIM = 32
_RMS_EPS = 1e-5
_ROPE_THETA = 10000.0
_WEIGHT_SEED = 1234


# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------


@lru_cache(maxsize=8)
def _trained_tokenizer_json(vocab_size: int) -> str:
    """Train the byte-level BPE once per vocab size and cache its JSON.

    Caching keeps repeated builds (one per test) cheap; returning the JSON
    string rather than the object means callers cannot mutate the cache.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)} for a byte-level BPE")

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=True)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        # The full 256-symbol byte alphabet, so *any* UTF-8 input encodes.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Lines in a fixed order: purely deterministic input.
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    # `train` registers the special tokens as added tokens with special=True,
    # so they are matched before pre-tokenization and skipped on decode.
    return tok.to_str(pretty=True)


def _tokenizer_vocab(tokenizer_json: Mapping[str, Any]) -> list[str]:
    """Return the token strings in id order (model vocab plus added tokens)."""
    id_to_token: dict[int, str] = {i: t for t, i in tokenizer_json["model"]["vocab"].items()}
    for added in tokenizer_json.get("added_tokens", []):
        id_to_token[int(added["id"])] = added["content"]
    n = max(id_to_token) + 1
    missing = [i for i in range(n) if i not in id_to_token]
    if missing:
        raise ValueError(f"tokenizer vocab has holes at ids {missing[:5]}")
    return [id_to_token[i] for i in range(n)]


def _tokenizer_merges(tokenizer_json: Mapping[str, Any]) -> list[str]:
    """Merges as ``"a b"`` strings (GGUF's form); newer tokenizers store pairs."""
    out: list[str] = []
    for m in tokenizer_json["model"]["merges"]:
        out.append(m if isinstance(m, str) else f"{m[0]} {m[1]}")
    return out


# --------------------------------------------------------------------------
# Model config and weights
# --------------------------------------------------------------------------


def tiny_llama_config(vocab_size: int, max_position_embeddings: int = 2048) -> dict[str, Any]:
    """The HF ``config.json`` for the tiny Llama (shared by HF and GGUF builders)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": _HIDDEN,
        "intermediate_size": _INTERMEDIATE,
        "num_hidden_layers": _LAYERS,
        "num_attention_heads": _HEADS,
        "num_key_value_heads": _KV_HEADS,
        "head_dim": _HEAD_DIM,
        "hidden_act": "silu",
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": _RMS_EPS,
        "rope_theta": _ROPE_THETA,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": IM_START_ID,
        "eos_token_id": IM_END_ID,
        "torch_dtype": "float32",
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "use_cache": True,
    }


def tiny_llama_weights(config: Mapping[str, Any], seed: int = _WEIGHT_SEED) -> dict[str, np.ndarray]:
    """Random float32 weights in HF/transformers layout and naming.

    Fixed seed so files are reproducible; small std so activations stay sane.
    Norm weights are ones, as a freshly initialised model would have.
    """
    rng = np.random.default_rng(seed)
    h = int(config["hidden_size"])
    inter = int(config["intermediate_size"])
    n_head = int(config["num_attention_heads"])
    n_kv = int(config["num_key_value_heads"])
    hd = int(config.get("head_dim") or h // n_head)
    vocab = int(config["vocab_size"])

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)

    w: dict[str, np.ndarray] = {"model.embed_tokens.weight": rand(vocab, h)}
    for i in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = rand(n_head * hd, h)
        w[p + "self_attn.k_proj.weight"] = rand(n_kv * hd, h)
        w[p + "self_attn.v_proj.weight"] = rand(n_kv * hd, h)
        w[p + "self_attn.o_proj.weight"] = rand(h, n_head * hd)
        w[p + "mlp.gate_proj.weight"] = rand(inter, h)
        w[p + "mlp.up_proj.weight"] = rand(inter, h)
        w[p + "mlp.down_proj.weight"] = rand(h, inter)
        w[p + "input_layernorm.weight"] = np.ones(h, dtype=np.float32)
        w[p + "post_attention_layernorm.weight"] = np.ones(h, dtype=np.float32)
    w["model.norm.weight"] = np.ones(h, dtype=np.float32)
    w["lm_head.weight"] = rand(vocab, h)
    return w


# --------------------------------------------------------------------------
# HF folder
# --------------------------------------------------------------------------


def _write_json(path: Path, obj: Any) -> None:
    """Stable, human-readable JSON (sorted keys would reorder HF's fields, so no)."""
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def build_tiny_hf_model(
    dest: Path,
    *,
    name: str = "tiny-chat",
    vocab_size: int = 512,
    chat_template: str | None = DEFAULT_CHAT_TEMPLATE,
    with_generation_config: bool = True,
    with_chat_template_file: bool = False,
    max_position_embeddings: int = 2048,
    with_weights: bool = True,
) -> Path:
    """Create ``dest / name``, an HF-style model folder, and return its path.

    The folder name is ``name`` because serving tools derive the default
    served-model name from the directory's last component.

    Files: ``tokenizer.json`` (byte-level BPE, specials at ids 0/1/2),
    ``config.json`` (2-layer Llama, hidden 64), ``tokenizer_config.json``
    (bos ``<|im_start|>``, eos ``<|im_end|>``, ChatML template unless
    ``chat_template`` is None), optionally ``chat_template.jinja`` (then the
    template is *not* in tokenizer_config.json), ``generation_config.json``
    (eos ``[2, 0]``) and ``model.safetensors`` (random float32).
    """
    folder = Path(dest) / name
    folder.mkdir(parents=True, exist_ok=True)

    tok_str = _trained_tokenizer_json(vocab_size)
    (folder / "tokenizer.json").write_text(tok_str, encoding="utf-8")
    real_vocab = len(_tokenizer_vocab(json.loads(tok_str)))

    config = tiny_llama_config(real_vocab, max_position_embeddings)
    config["_name_or_path"] = name
    _write_json(folder / "config.json", config)

    tok_cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[IM_START_ID],
        "eos_token": SPECIAL_TOKENS[IM_END_ID],
        "pad_token": SPECIAL_TOKENS[ENDOFTEXT_ID],
        "unk_token": None,
        "model_max_length": max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(i): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i, t in enumerate(SPECIAL_TOKENS)
        },
    }
    jinja_file = folder / "chat_template.jinja"
    if chat_template is not None and with_chat_template_file:
        jinja_file.write_text(chat_template, encoding="utf-8")
    else:
        if jinja_file.exists():  # rebuilding into an old folder
            jinja_file.unlink()
        if chat_template is not None:
            tok_cfg["chat_template"] = chat_template
    _write_json(folder / "tokenizer_config.json", tok_cfg)

    gen_file = folder / "generation_config.json"
    if with_generation_config:
        _write_json(gen_file, {"bos_token_id": IM_START_ID, "eos_token_id": [IM_END_ID, ENDOFTEXT_ID]})
    elif gen_file.exists():
        gen_file.unlink()

    weights_file = folder / "model.safetensors"
    if with_weights:
        from safetensors.numpy import save_file

        save_file(tiny_llama_weights(config), str(weights_file), metadata={"format": "pt"})
    elif weights_file.exists():
        weights_file.unlink()

    return folder


# --------------------------------------------------------------------------
# GGUF
# --------------------------------------------------------------------------


def hf_to_gguf_rope_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Reorder q/k projection rows from HF's half-split RoPE to llama.cpp's.

    HF Llama rotates dimension pairs (i, i + d/2) of each head; llama.cpp's
    LLAMA rope rotates adjacent pairs (2i, 2i + 1).  Swapping the "half" and
    "pair index" axes of each head maps one layout onto the other, so the
    GGUF model computes the same function as the safetensors one.
    """
    rows = w.shape[0]
    return (
        w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


_GGUF_TENSOR_NAMES: dict[str, str] = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _gguf_tensors(config: Mapping[str, Any], weights: Mapping[str, np.ndarray]) -> list[tuple[str, np.ndarray]]:
    """Map HF tensors to llama.cpp names (and rope layout), in a stable order."""
    n_head = int(config["num_attention_heads"])
    n_kv = int(config["num_key_value_heads"])
    out: list[tuple[str, np.ndarray]] = [("token_embd.weight", weights["model.embed_tokens.weight"])]
    for i in range(int(config["num_hidden_layers"])):
        for hf_part, gg_part in _GGUF_TENSOR_NAMES.items():
            arr = weights[f"model.layers.{i}.{hf_part}.weight"]
            if hf_part == "self_attn.q_proj":
                arr = hf_to_gguf_rope_permute(arr, n_head)
            elif hf_part == "self_attn.k_proj":
                arr = hf_to_gguf_rope_permute(arr, n_kv)
            out.append((f"blk.{i}.{gg_part}.weight", arr))
    out.append(("output_norm.weight", weights["model.norm.weight"]))
    out.append(("output.weight", weights["lm_head.weight"]))
    return [(n, np.ascontiguousarray(a, dtype=np.float32)) for n, a in out]


def _read_chat_template(hf_dir: Path) -> str | None:
    """The folder's chat template, preferring ``chat_template.jinja`` like HF does."""
    jinja_file = hf_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    cfg_file = hf_dir / "tokenizer_config.json"
    if cfg_file.is_file():
        tpl = json.loads(cfg_file.read_text(encoding="utf-8")).get("chat_template")
        if isinstance(tpl, str):
            return tpl
    return None


def build_tiny_gguf(dest_file: Path, hf_dir: Path) -> Path:
    """Write the HF folder's tiny Llama as a single F32 GGUF and return its path.

    Reads config, tokenizer and chat template from ``hf_dir`` so both formats
    describe the same model; if ``hf_dir`` has no weights file the same seeded
    random weights are regenerated.  Metadata follows what llama.cpp's loader
    needs for a ``gpt2``-style BPE vocab (``pre`` must be ``gpt-2``).
    """
    import gguf

    hf_dir = Path(hf_dir)
    dest_file = Path(dest_file)
    dest_file.parent.mkdir(parents=True, exist_ok=True)

    config = json.loads((hf_dir / "config.json").read_text(encoding="utf-8"))
    tok_json = json.loads((hf_dir / "tokenizer.json").read_text(encoding="utf-8"))
    tokens = _tokenizer_vocab(tok_json)
    merges = _tokenizer_merges(tok_json)
    special_ids = {int(a["id"]) for a in tok_json.get("added_tokens", []) if a.get("special")}
    token_types = [
        int(gguf.TokenType.CONTROL) if i in special_ids else int(gguf.TokenType.NORMAL)
        for i in range(len(tokens))
    ]

    weights_file = hf_dir / "model.safetensors"
    if weights_file.is_file():
        from safetensors.numpy import load_file

        weights = load_file(str(weights_file))
    else:
        weights = tiny_llama_weights(config)

    n_head = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or config["hidden_size"] // n_head)
    name = str(config.get("_name_or_path") or hf_dir.name)

    writer = gguf.GGUFWriter(str(dest_file), "llama")
    try:
        writer.add_name(name)
        writer.add_file_type(int(gguf.LlamaFileType.ALL_F32))
        writer.add_vocab_size(len(tokens))
        writer.add_context_length(int(config["max_position_embeddings"]))
        writer.add_embedding_length(int(config["hidden_size"]))
        writer.add_block_count(int(config["num_hidden_layers"]))
        writer.add_feed_forward_length(int(config["intermediate_size"]))
        writer.add_head_count(n_head)
        writer.add_head_count_kv(int(config["num_key_value_heads"]))
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
        writer.add_rope_freq_base(float(config["rope_theta"]))
        writer.add_rope_dimension_count(head_dim)

        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("gpt-2")
        writer.add_token_list(tokens)
        writer.add_token_types(token_types)
        writer.add_token_merges(merges)
        writer.add_bos_token_id(int(config["bos_token_id"]))
        writer.add_eos_token_id(int(config["eos_token_id"]))
        writer.add_pad_token_id(ENDOFTEXT_ID)
        # The HF tokenizer adds no BOS/EOS on encode; say so explicitly so
        # llama.cpp's BPE default (add BOS) doesn't make the two disagree.
        writer.add_add_bos_token(False)
        writer.add_add_eos_token(False)
        template = _read_chat_template(hf_dir)
        if template is not None:
            writer.add_chat_template(template)

        for tname, arr in _gguf_tensors(config, weights):
            writer.add_tensor(tname, arr)

        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return dest_file


# --------------------------------------------------------------------------
# Broken files
# --------------------------------------------------------------------------


def write_corrupt_gguf(path: Path) -> Path:
    """A file that starts with the GGUF magic but is garbage after it.

    Loaders that only sniff the magic will accept it, so it exercises the
    error path of the real header parser.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0xBAD)
    path.write_bytes(b"GGUF" + rng.integers(0, 256, size=1020, dtype=np.uint8).tobytes())
    return path


def write_truncated_gguf(src: Path, dst: Path) -> Path:
    """Copy the first half of a real GGUF: valid header, missing tensor data."""
    data = Path(src).read_bytes()
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(data[: len(data) // 2])
    return dst


# --------------------------------------------------------------------------
# Rendering helper
# --------------------------------------------------------------------------


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
    **extra: Any,
) -> str:
    """Render a chat template the way HF transformers does, for expectations.

    Uses a sandboxed jinja2 environment with trim_blocks/lstrip_blocks and a
    ``raise_exception`` global, so tests can check the reference rendering
    independently of the project's own renderer.
    """
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(
        messages=list(messages),
        add_generation_prompt=add_generation_prompt,
        tools=list(tools) if tools is not None else None,
        **extra,
    )


if __name__ == "__main__":  # pragma: no cover - manual inspection aid
    import sys
    import tempfile

    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp())
    d = build_tiny_hf_model(out)
    g = build_tiny_gguf(out / "tiny-chat.gguf", d)
    print(d, g, os.path.getsize(g))
