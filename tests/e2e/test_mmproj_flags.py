"""``--mmproj`` that cannot work: one clear line on stderr, a non-zero exit and no traceback.  A file that
is not there, a GGUF that is not a projector (the text model itself), a projector of another model's width,
and the flag with an engine that loads no projector."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.proc import run_cli


def fails_with_one_line(args: list[str]) -> str:
    p = run_cli(["in=stdin", *args], input="hi", timeout=120)
    assert p.returncode != 0, (p.stdout, p.stderr)
    assert "Traceback" not in p.stderr, p.stderr
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1, p.stderr
    return errors[0]


def test_a_missing_projector_file(gguf: Path, tmp_path: Path) -> None:
    line = fails_with_one_line(["out=llamacpp", str(gguf), "--mmproj", str(tmp_path / "nope.gguf")])
    assert "--mmproj" in line and "no such file" in line


def test_a_gguf_that_is_not_a_projector(gguf: Path) -> None:
    line = fails_with_one_line(["out=llamacpp", str(gguf), "--mmproj", str(gguf)])
    assert "cannot load it as a projector" in line


def test_a_projector_of_another_width(gguf: Path, tmp_path: Path) -> None:
    """The colour projector built for a 64-wide model: llama.cpp refuses it for SmolLM2 (576 wide)."""
    import gguf as gg
    import numpy as np

    from harness.colour_projector import write_colour_projector

    narrow = tmp_path / "narrow.gguf"
    w = gg.GGUFWriter(str(narrow), "llama")
    w.add_token_list([f"t{i}" for i in range(8)] + ["Ġ" + c for c in
                      ("black", "red", "green", "blue", "yellow", "purple", "cyan", "white")])
    w.add_tensor("token_embd.weight", np.ones((16, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    proj = write_colour_projector(tmp_path / "proj64.gguf", narrow)
    line = fails_with_one_line(["out=llamacpp", str(gguf), "--mmproj", str(proj)])
    assert "cannot load it as a projector" in line


@pytest.mark.parametrize("engine", ["echo_core", "echo_full"])
def test_an_engine_that_loads_no_projector(engine: str, tiny_model: Path, colour_projector: Path) -> None:
    line = fails_with_one_line([f"out={engine}", str(tiny_model), "--mmproj", str(colour_projector)])
    assert "--mmproj: only out=llamacpp" in line
