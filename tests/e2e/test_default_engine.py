"""With no ``out=``, the best installed engine for the model is chosen (GGUF: llamacpp, then mistralrs;
folder: vllm, then mistralrs), the choice is logged, and with none installed the error says what to install."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

from dynamo.engines import served_model
from dynamo.errors import UserError
from dynamo.llm.model_card import ModelCard
from harness.proc import run_cli
from harness.tiny_model import build_tiny_gguf, build_tiny_hf_model


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("default-engine")
    folder = build_tiny_hf_model(root, name="tiny-chat")
    return {"folder": folder, "gguf": build_tiny_gguf(root / "tiny-chat.gguf", folder)}


@pytest.mark.skipif(not _installed("llama_cpp"), reason="llama-cpp-python not installed")
def test_gguf_defaults_to_llamacpp(tiny: dict[str, Path]) -> None:
    p = run_cli(["in=stdin", str(tiny["gguf"])], input="Hello", timeout=120)
    assert p.returncode == 0, p.stderr
    assert "Using default engine: llamacpp" in p.stderr


@pytest.mark.skipif(_installed("vllm") or not _installed("mistralrs"),
                    reason="needs mistralrs installed and vllm not installed")
def test_folder_defaults_to_mistralrs_without_vllm(tiny: dict[str, Path]) -> None:
    p = run_cli(["in=stdin", str(tiny["folder"])], input="Hello", timeout=120)
    assert p.returncode == 0, p.stderr
    assert "Using default engine: mistralrs" in p.stderr


def _cfg(model: str = "m") -> SimpleNamespace:
    return SimpleNamespace(engine=None, model=model)


@pytest.mark.parametrize(
    ("gguf", "installed", "expected"),
    [
        (True, {"llamacpp", "mistralrs"}, "llamacpp"),
        (True, {"mistralrs"}, "mistralrs"),
        (False, {"vllm", "mistralrs", "llamacpp"}, "vllm"),
        (False, {"mistralrs", "llamacpp"}, "mistralrs"),
    ],
)
def test_choose_engine_order(monkeypatch: pytest.MonkeyPatch, gguf: bool, installed: set[str], expected: str) -> None:
    monkeypatch.setattr(served_model, "engine_installed", lambda name: name in installed)
    card = ModelCard("m", gguf_path=Path("/x.gguf") if gguf else None)
    assert served_model.choose_engine(_cfg(), card) == expected  # type: ignore[arg-type]


def test_no_engine_installed_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(served_model, "engine_installed", lambda name: False)
    with pytest.raises(UserError) as info:
        served_model.choose_engine(_cfg(), ModelCard("m", gguf_path=Path("/x.gguf")))  # type: ignore[arg-type]
    assert "llama-cpp-python" in str(info.value) and "mistralrs" in str(info.value)
    with pytest.raises(UserError) as info:
        served_model.choose_engine(_cfg(), ModelCard("m"))  # type: ignore[arg-type]
    assert "vllm" in str(info.value) and "mistralrs" in str(info.value)
