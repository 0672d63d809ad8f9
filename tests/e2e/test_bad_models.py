"""Bad model input: each case is one clear line on stderr, a non-zero exit and no traceback.

Missing files, folders that are not models, corrupt and truncated GGUF files, an architecture the
engine does not know, and a ``--context-length`` beyond the model's.
"""

from __future__ import annotations

import importlib.util
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from harness.proc import run_cli
from harness.tiny_model import (
    build_tiny_gguf,
    build_tiny_hf_model,
    write_corrupt_gguf,
    write_truncated_gguf,
)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad")
    folder = build_tiny_hf_model(root, name="tiny-chat")
    gguf = build_tiny_gguf(root / "tiny-chat.gguf", folder)
    return {
        "folder": folder,
        "gguf": gguf,
        "corrupt": write_corrupt_gguf(root / "corrupt.gguf"),
        "truncated": write_truncated_gguf(gguf, root / "truncated.gguf"),
        "madeup": _madeup_arch_gguf(root / "madeup.gguf", gguf),
    }


def _madeup_arch_gguf(dest: Path, tiny_gguf: Path) -> Path:
    """A well-formed GGUF with a real vocabulary but ``general.architecture = "madeup"``."""
    import gguf

    from dynamo.llm.gguf_card import read_metadata

    meta = read_metadata(tiny_gguf)
    w = gguf.GGUFWriter(str(dest), "madeup")
    w.add_context_length(2048)
    w.add_block_count(1)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_token_merges(meta["tokenizer.ggml.merges"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(meta["tokenizer.chat_template"])
    w.add_tensor("token_embd.weight", np.zeros((len(meta["tokenizer.ggml.tokens"]), 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dest


def _fails_with_one_line(args: list[str], *, timeout: float = 60) -> str:
    t0 = time.monotonic()
    p = run_cli(["in=stdin", *args], input="hi", timeout=timeout)
    assert p.returncode != 0, (p.stdout, p.stderr)
    assert "Traceback" not in p.stderr, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("Error:")]
    assert len(errors) == 1, p.stderr
    # nothing but log lines beside the error (an engine's own chatter would be a bug)
    assert all(ln.startswith("Error:") or " INFO " in ln or " WARN" in ln for ln in lines), p.stderr
    assert time.monotonic() - t0 < timeout
    return errors[0]


def test_missing_file(tmp_path: Path) -> None:
    line = _fails_with_one_line(["out=echo_core", str(tmp_path / "nope.gguf")])
    assert "nope.gguf: no such file or directory" in line
    # a relative path that names a .gguf file is a missing file, not a hub repo
    line = _fails_with_one_line(["out=echo_core", "models/nope.gguf"])
    assert "no such file or directory" in line and "Hugging Face" not in line


def test_folder_without_tokenizer(tmp_path: Path, models: dict[str, Path]) -> None:
    folder = tmp_path / "no-tokenizer"
    folder.mkdir()
    (folder / "config.json").write_text((models["folder"] / "config.json").read_text())
    line = _fails_with_one_line(["out=echo_core", str(folder)])
    assert "no tokenizer.json" in line


def test_empty_folder(tmp_path: Path) -> None:
    line = _fails_with_one_line(["out=echo_core", str(tmp_path)])
    assert "empty folder" in line


def test_not_a_model_file(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("hello\n")
    assert "not a GGUF file" in _fails_with_one_line(["out=echo_core", str(text)])
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    assert "empty file" in _fails_with_one_line(["out=echo_core", str(empty)])


@pytest.mark.parametrize("engine", ["echo_core", "llamacpp", "mistralrs"])
def test_corrupt_gguf(models: dict[str, Path], engine: str) -> None:
    line = _fails_with_one_line([f"out={engine}", str(models["corrupt"])], timeout=30)
    assert "corrupt GGUF file" in line and "version" in line


@pytest.mark.parametrize("engine", ["echo_core", "llamacpp", "mistralrs"])
def test_truncated_gguf(models: dict[str, Path], engine: str) -> None:
    line = _fails_with_one_line([f"out={engine}", str(models["truncated"])], timeout=30)
    assert "truncated GGUF file" in line
    size = models["truncated"].stat().st_size
    assert f"the file has {size}" in line


def test_truncated_real_model_fails_fast(tmp_path: Path) -> None:
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run([str(repo / "scripts" / "smollm2-path.sh")], capture_output=True, text=True)
    real = Path(out.stdout.strip())
    if out.returncode != 0 or not real.is_file():
        pytest.skip("SmolLM2 GGUF not installed")
    cut = write_truncated_gguf(real, tmp_path / "smol-cut.gguf")
    t0 = time.monotonic()
    line = _fails_with_one_line(["out=echo_core", str(cut)])
    assert "truncated GGUF file" in line
    assert time.monotonic() - t0 < 20


def test_unknown_architecture_llamacpp(models: dict[str, Path]) -> None:
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python not installed")
    line = _fails_with_one_line(["out=llamacpp", str(models["madeup"])])
    assert "architecture" in line and "madeup.gguf" in line


def test_unknown_architecture_mistralrs(models: dict[str, Path]) -> None:
    if importlib.util.find_spec("mistralrs") is None:
        pytest.skip("mistralrs not installed")
    line = _fails_with_one_line(["out=mistralrs", str(models["madeup"])])
    assert "architecture" in line and "madeup" in line


def test_context_length_larger_than_the_models(models: dict[str, Path]) -> None:
    for model in (models["folder"], models["gguf"]):
        line = _fails_with_one_line(["out=echo_core", str(model), "--context-length", "4096"])
        assert "--context-length 4096" in line and "2048" in line


def test_folder_with_several_gguf_files(tmp_path: Path, models: dict[str, Path]) -> None:
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(models["gguf"].read_bytes())
    line = _fails_with_one_line(["out=echo_core", str(tmp_path)])
    assert "a.gguf" in line and "b.gguf" in line


def test_folder_with_one_gguf_file_is_served(tmp_path: Path, models: dict[str, Path]) -> None:
    (tmp_path / "only.gguf").write_bytes(models["gguf"].read_bytes())
    p = run_cli(["in=stdin", "out=echo_core", str(tmp_path)], input="hello", timeout=60)
    assert p.returncode == 0, p.stderr
    assert "hello" in p.stdout
