"""Checks that the test-model builders produce folders real loaders accept.

Other tests rely on these fixtures instead of downloaded models, so a subtle
mistake here (wrong special-token ids, a template that renders differently,
q/k weights in the wrong rope layout) would silently skew everything else.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

_REPO_ROOT = Path(__file__).resolve().parents[3]
if str(_REPO_ROOT) not in sys.path:  # `tests` has no __init__.py; make it importable
    sys.path.insert(0, str(_REPO_ROOT))

from harness.tiny_model import (  # noqa: E402
    DEFAULT_CHAT_TEMPLATE,
    ENDOFTEXT_ID,
    IM_END_ID,
    IM_START_ID,
    MULTIBYTE_SAMPLES,
    SPECIAL_TOKENS,
    build_tiny_gguf,
    build_tiny_hf_model,
    hf_to_gguf_rope_permute,
    render_chat_template,
    write_corrupt_gguf,
    write_truncated_gguf,
)

gguf = pytest.importorskip("gguf")
tokenizers = pytest.importorskip("tokenizers")
jinja2 = pytest.importorskip("jinja2")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_hf_model(tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def gguf_file(hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-chat.gguf", hf_dir)


def _field(reader: "gguf.GGUFReader", key: str):
    field = reader.get_field(key)
    assert field is not None, f"missing GGUF key {key}"
    return field.contents()


# ---------------------------------------------------------------- HF folder


def test_folder_layout(hf_dir: Path) -> None:
    assert hf_dir.name == "tiny-chat"
    names = {p.name for p in hf_dir.iterdir()}
    assert names == {
        "tokenizer.json",
        "config.json",
        "tokenizer_config.json",
        "generation_config.json",
        "model.safetensors",
    }


def test_config_matches_tokenizer(hf_dir: Path) -> None:
    cfg = json.loads((hf_dir / "config.json").read_text())
    tok = tokenizers.Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["model_type"] == "llama"
    assert cfg["vocab_size"] == tok.get_vocab_size() == 512
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["head_dim"]) == (64, 2, 32)
    assert cfg["bos_token_id"] == IM_START_ID and cfg["eos_token_id"] == IM_END_ID
    assert cfg["tie_word_embeddings"] is False
    gen = json.loads((hf_dir / "generation_config.json").read_text())
    assert gen == {"bos_token_id": 1, "eos_token_id": [2, 0]}


def test_tokenizer_config(hf_dir: Path) -> None:
    tc = json.loads((hf_dir / "tokenizer_config.json").read_text())
    assert tc["bos_token"] == "<|im_start|>"
    assert tc["eos_token"] == "<|im_end|>"
    assert tc["unk_token"] is None
    assert tc["model_max_length"] == 2048
    assert tc["chat_template"] == DEFAULT_CHAT_TEMPLATE


def test_special_tokens_are_single_ids(hf_dir: Path) -> None:
    tok = tokenizers.Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    for expected_id, text in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(text) == expected_id
        assert tok.encode(text, add_special_tokens=False).ids == [expected_id]
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>").ids
    assert ids[0] == IM_START_ID and ids[-1] == IM_END_ID
    assert ENDOFTEXT_ID not in ids
    # Specials are skipped on decode by default, kept on request.
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


@pytest.mark.parametrize("text", [*MULTIBYTE_SAMPLES, " leading space", "a\n\tb  c", "🙂🙂🙂", "x" * 100])
def test_round_trip(hf_dir: Path, text: str) -> None:
    tok = tokenizers.Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text


def test_round_trip_unseen_bytes(hf_dir: Path) -> None:
    """The full byte alphabet is in the vocab, so text outside the corpus works."""
    tok = tokenizers.Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    text = "Ωmega ∮ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \u0000\u007f ﷽"
    assert tok.decode(tok.encode(text).ids) == text


def test_merges_exist(hf_dir: Path) -> None:
    """Common words must compress, or this is just a byte tokenizer."""
    tok = tokenizers.Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    assert len(tok.encode(" the").ids) == 1
    assert len(tok.encode("café").ids) < len("café".encode())


def test_chat_template_renders_chatml(hf_dir: Path) -> None:
    tc = json.loads((hf_dir / "tokenizer_config.json").read_text())
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(msg: str) -> None:
        raise jinja2.TemplateError(msg)

    env.globals["raise_exception"] = raise_exception
    messages = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi there"}]
    out = env.from_string(tc["chat_template"]).render(messages=messages, add_generation_prompt=False)
    assert out == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHello<|im_end|>\n"
        "<|im_start|>assistant\nHi there<|im_end|>\n"
    )
    out = env.from_string(tc["chat_template"]).render(messages=messages[:1], add_generation_prompt=True)
    assert out.endswith("<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n")


def test_chat_template_explicit_system_and_tools() -> None:
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Weather?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    out = render_chat_template(DEFAULT_CHAT_TEMPLATE, messages, tools=tools)
    assert out.startswith("<|im_start|>system\nBe terse.")
    assert "You are a helpful assistant." not in out
    assert '"get_weather"' in out and "<tools>" in out
    assert out.count("<|im_start|>") == 2
    # Without tools there is no tools block.
    assert "<tools>" not in render_chat_template(DEFAULT_CHAT_TEMPLATE, messages)


def test_chat_template_tool_calls() -> None:
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "w", "arguments": '{"city": "Paris"}'}}],
        },
        {"role": "tool", "content": "sunny"},
    ]
    out = render_chat_template(DEFAULT_CHAT_TEMPLATE, messages)
    assert '<tool_call>{"name": "w", "arguments": {"city": "Paris"}}</tool_call><|im_end|>' in out
    assert "<|im_start|>tool\nsunny<|im_end|>\n" in out


def test_chat_template_rejects_unknown_role() -> None:
    with pytest.raises(jinja2.TemplateError, match="Unsupported message role: wizard"):
        render_chat_template(DEFAULT_CHAT_TEMPLATE, [{"role": "wizard", "content": "x"}])


def test_build_options(tmp_path: Path) -> None:
    d = build_tiny_hf_model(
        tmp_path,
        name="other",
        vocab_size=300,
        with_generation_config=False,
        with_chat_template_file=True,
        max_position_embeddings=128,
        with_weights=False,
    )
    assert d == tmp_path / "other"
    names = {p.name for p in d.iterdir()}
    assert names == {"tokenizer.json", "config.json", "tokenizer_config.json", "chat_template.jinja"}
    tc = json.loads((d / "tokenizer_config.json").read_text())
    assert "chat_template" not in tc
    assert tc["model_max_length"] == 128
    assert (d / "chat_template.jinja").read_text() == DEFAULT_CHAT_TEMPLATE
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["vocab_size"] == 300 and cfg["max_position_embeddings"] == 128

    bare = build_tiny_hf_model(tmp_path, name="bare", chat_template=None)
    assert "chat_template" not in json.loads((bare / "tokenizer_config.json").read_text())
    assert not (bare / "chat_template.jinja").exists()


def test_weights(hf_dir: Path) -> None:
    from safetensors.numpy import load_file

    w = load_file(str(hf_dir / "model.safetensors"))
    assert w["model.embed_tokens.weight"].shape == (512, 64)
    assert w["lm_head.weight"].shape == (512, 64)
    assert w["model.layers.1.self_attn.q_proj.weight"].shape == (64, 64)
    assert w["model.layers.0.mlp.down_proj.weight"].shape == (64, 128)
    assert w["model.norm.weight"].shape == (64,)
    assert all(a.dtype == np.float32 for a in w.values())
    assert len(w) == 3 + 9 * 2


def test_deterministic(tmp_path: Path) -> None:
    a = build_tiny_hf_model(tmp_path / "a")
    b = build_tiny_hf_model(tmp_path / "b")
    for name in ("tokenizer.json", "config.json", "tokenizer_config.json", "model.safetensors"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    ga = build_tiny_gguf(tmp_path / "a.gguf", a)
    gb = build_tiny_gguf(tmp_path / "b.gguf", b)
    assert ga.read_bytes() == gb.read_bytes()


def test_builds_train_the_tokenizer_once_per_vocab_size(tmp_path: Path) -> None:
    """What keeps a build cheap (one per test): the BPE is trained once per vocab size, later builds
    reuse it, and a build at a new size is a whole, loadable model."""
    from harness.tiny_model import _trained_tokenizer_json

    before = _trained_tokenizer_json.cache_info()
    d = build_tiny_hf_model(tmp_path / "a", name="fast", vocab_size=400)  # uncached vocab size
    after_first = _trained_tokenizer_json.cache_info()
    assert after_first.misses == before.misses + 1  # trained once
    again = build_tiny_hf_model(tmp_path / "b", name="fast", vocab_size=400)
    assert _trained_tokenizer_json.cache_info().misses == after_first.misses  # not trained again
    assert (again / "tokenizer.json").read_bytes() == (d / "tokenizer.json").read_bytes()
    tok = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
    assert tok.get_vocab_size() == 400
    r = gguf.GGUFReader(str(build_tiny_gguf(tmp_path / "fast.gguf", d)))
    assert len(r.fields["tokenizer.ggml.tokens"].data) == 400


# ---------------------------------------------------------------- GGUF


def test_gguf_metadata(gguf_file: Path, hf_dir: Path) -> None:
    r = gguf.GGUFReader(str(gguf_file))
    assert _field(r, "general.architecture") == "llama"
    assert _field(r, "llama.context_length") == 2048
    assert _field(r, "llama.embedding_length") == 64
    assert _field(r, "llama.block_count") == 2
    assert _field(r, "llama.feed_forward_length") == 128
    assert _field(r, "llama.attention.head_count") == 2
    assert _field(r, "llama.attention.head_count_kv") == 2
    assert _field(r, "llama.rope.dimension_count") == 32
    assert _field(r, "llama.attention.layer_norm_rms_epsilon") == pytest.approx(1e-5)
    assert _field(r, "llama.rope.freq_base") == pytest.approx(10000.0)
    assert _field(r, "tokenizer.ggml.model") == "gpt2"
    assert _field(r, "tokenizer.ggml.pre") == "gpt-2"
    assert _field(r, "tokenizer.ggml.bos_token_id") == IM_START_ID
    assert _field(r, "tokenizer.ggml.eos_token_id") == IM_END_ID
    assert _field(r, "tokenizer.chat_template") == DEFAULT_CHAT_TEMPLATE

    tok_json = json.loads((hf_dir / "tokenizer.json").read_text())
    tokens = _field(r, "tokenizer.ggml.tokens")
    assert len(tokens) == 512
    assert tokens[:3] == list(SPECIAL_TOKENS)
    assert all(tokens[i] == t for t, i in tok_json["model"]["vocab"].items())
    types = _field(r, "tokenizer.ggml.token_type")
    assert types[:3] == [3, 3, 3] and set(types[3:]) == {1}
    merges = _field(r, "tokenizer.ggml.merges")
    assert merges == [" ".join(m) for m in tok_json["model"]["merges"]]


def test_gguf_tensors(gguf_file: Path, hf_dir: Path) -> None:
    from safetensors.numpy import load_file

    r = gguf.GGUFReader(str(gguf_file))
    assert len(r.tensors) == 3 + 9 * 2
    by_name = {t.name: t for t in r.tensors}
    assert {"token_embd.weight", "output_norm.weight", "output.weight", "blk.1.ffn_down.weight"} <= set(by_name)
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in r.tensors)
    # GGUF stores dims innermost-first.
    assert list(by_name["token_embd.weight"].shape) == [64, 512]

    hf = load_file(str(hf_dir / "model.safetensors"))
    np.testing.assert_array_equal(by_name["output.weight"].data, hf["lm_head.weight"])
    np.testing.assert_array_equal(by_name["blk.0.attn_v.weight"].data, hf["model.layers.0.self_attn.v_proj.weight"])
    q_hf = hf["model.layers.0.self_attn.q_proj.weight"]
    q_gg = np.asarray(by_name["blk.0.attn_q.weight"].data)
    assert not np.array_equal(q_gg, q_hf)  # it really was permuted
    np.testing.assert_array_equal(q_gg, hf_to_gguf_rope_permute(q_hf, 2))


def _rope_half_split(x: np.ndarray, pos: int, theta: float = 10000.0) -> np.ndarray:
    """HF Llama rope: rotate pairs (i, i + d/2)."""
    d = x.shape[-1]
    freqs = theta ** (-np.arange(0, d, 2) / d) * pos
    cos, sin = np.cos(freqs), np.sin(freqs)
    a, b = x[: d // 2], x[d // 2 :]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos])


def _rope_interleaved(x: np.ndarray, pos: int, theta: float = 10000.0) -> np.ndarray:
    """llama.cpp LLAMA rope: rotate adjacent pairs (2i, 2i + 1)."""
    d = x.shape[-1]
    freqs = theta ** (-np.arange(0, d, 2) / d) * pos
    cos, sin = np.cos(freqs), np.sin(freqs)
    a, b = x[0::2], x[1::2]
    out = np.empty_like(x)
    out[0::2] = a * cos - b * sin
    out[1::2] = a * sin + b * cos
    return out


def test_rope_permutation_preserves_attention_scores() -> None:
    """q·k after rope must be identical in both layouts, or GGUF outputs differ."""
    rng = np.random.default_rng(0)
    n_head, hd, hidden = 2, 32, 64
    wq = rng.standard_normal((n_head * hd, hidden))
    wk = rng.standard_normal((n_head * hd, hidden))
    xq, xk = rng.standard_normal(hidden), rng.standard_normal(hidden)
    pq, pk = 7, 3

    def scores(wq_: np.ndarray, wk_: np.ndarray, rope) -> np.ndarray:
        q = (wq_ @ xq).reshape(n_head, hd)
        k = (wk_ @ xk).reshape(n_head, hd)
        return np.array([rope(q[h], pq) @ rope(k[h], pk) for h in range(n_head)])

    hf = scores(wq, wk, _rope_half_split)
    gg = scores(hf_to_gguf_rope_permute(wq, n_head), hf_to_gguf_rope_permute(wk, n_head), _rope_interleaved)
    np.testing.assert_allclose(gg, hf, rtol=1e-10)
    # And the unpermuted weights with llama.cpp rope would be wrong.
    assert not np.allclose(scores(wq, wk, _rope_interleaved), hf)


def test_gguf_from_folder_without_weights_or_template(tmp_path: Path) -> None:
    d = build_tiny_hf_model(tmp_path, with_weights=False, chat_template=None)
    r = gguf.GGUFReader(str(build_tiny_gguf(tmp_path / "m.gguf", d)))
    assert r.get_field("tokenizer.chat_template") is None
    assert len(r.tensors) == 21


def test_gguf_uses_chat_template_file(tmp_path: Path) -> None:
    d = build_tiny_hf_model(tmp_path, with_chat_template_file=True, chat_template="{{ 'x' }}", with_weights=False)
    r = gguf.GGUFReader(str(build_tiny_gguf(tmp_path / "m.gguf", d)))
    assert _field(r, "tokenizer.chat_template") == "{{ 'x' }}"


# ---------------------------------------------------------------- broken files


def test_corrupt_gguf_is_rejected(tmp_path: Path) -> None:
    p = write_corrupt_gguf(tmp_path / "bad.gguf")
    assert p.read_bytes()[:4] == b"GGUF"
    with pytest.raises(ValueError):
        gguf.GGUFReader(str(p))


def test_truncated_gguf_is_rejected(gguf_file: Path, tmp_path: Path) -> None:
    p = write_truncated_gguf(gguf_file, tmp_path / "half.gguf")
    assert p.stat().st_size == gguf_file.stat().st_size // 2
    assert p.read_bytes()[:4] == b"GGUF"
    with pytest.raises(ValueError):
        gguf.GGUFReader(str(p))
