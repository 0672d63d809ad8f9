"""llama.cpp's native library on this CPU: it decodes here (a real check, in a child process), and where it
would die of SIGILL the user reads one line naming the signal, the library file and the fix, instead of a bare
"Illegal instruction" (engines/llamacpp/preflight.py).

The first test is real: the installed library decodes SmolLM2 in a child process with every kernel, and was
built only for instruction sets that the setup's probe (scripts/llamacpp_cmake_args.py) proves run here.  On
a machine where it cannot, this test fails with the preflight's line and the other llama.cpp tests are
skipped with it (harness/smollm2.py), so the run ends with a reason instead of a crashed pytest.

The others inject the trap (harness/native_fault.py: a real SIGILL sent from inside ``llama_decode``), since
a library that traps for real needs a CPU and compiler that build one.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from harness.native_fault import native_fault_env
from harness.proc import cli_env, run_cli
from harness.smollm2 import NotInstalled, smollm2_gguf

REPO = Path(__file__).resolve().parents[2]
FIX = "scripts/setup-venv.sh --rebuild-llamacpp"


@pytest.fixture(scope="module")
def model() -> Path:
    try:  # not the gguf fixture: that one skips where the library cannot decode, which this test is to report
        return smollm2_gguf()
    except NotInstalled as e:
        if "SIGILL" not in str(e) and "dies of" not in str(e):
            pytest.skip(str(e))
        return Path(subprocess.run([str(REPO / "scripts" / "smollm2-path.sh")], capture_output=True,
                                   text=True).stdout.strip())


def options_on(cmake_args: str) -> set[str]:
    return {a.removeprefix("-D").removesuffix("=ON") for a in cmake_args.split() if a.endswith("=ON")}


def test_installed_library_decodes_on_this_cpu(model: Path, tmp_path: Path):
    done = subprocess.run([sys.executable, "-m", "dynamo.engines.llamacpp.preflight", "check", "--fresh", str(model)],
                          capture_output=True, text=True, timeout=600,
                          env=cli_env({"XDG_CACHE_HOME": str(tmp_path)}))
    assert done.returncode == 0, done.stdout.strip() or done.stderr
    assert "decodes" in done.stdout
    # built by scripts/install-llamacpp.sh: only with instruction sets that the probe proves run here
    marker = Path(sys.prefix) / ".llamacpp-wheel"
    if not marker.is_file():
        pytest.skip("llama-cpp-python was not installed by scripts/install-llamacpp.sh: its flags are unknown")
    built = (Path(marker.read_text().strip()).parent / "CMAKE_ARGS").read_text()
    probe = subprocess.run([sys.executable, str(REPO / "scripts" / "llamacpp_cmake_args.py")],
                           capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, probe.stderr
    unproven = options_on(built) - options_on(probe.stdout) - {"GGML_NATIVE"}
    assert not unproven, f"built with {sorted(unproven)}, which the probe finds do not run here"


def sigill_lines(stderr: str) -> list[str]:
    """The lines naming SIGILL, without the log's time stamp."""
    return [x[x.find("llama.cpp's"):] for x in stderr.splitlines() if "SIGILL" in x]


def test_text_mode_answers_without_the_kernels_that_die(model: Path, tmp_path: Path):
    env = native_fault_env(tmp_path, "extra_bufts")
    args = ["in=text", "out=llamacpp", str(model), "--context-length", "512"]
    first = run_cli(args, input="What is 2+2?\n", env=env, timeout=180)
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip(), "no answer"
    [line] = sigill_lines(first.stderr)
    assert "Illegal instruction" in line and "libggml-cpu" in line and FIX in line, line
    assert "running without them" in line, line
    assert "Traceback" not in first.stderr
    # the verdict is cached by the library's hash: a second start asks no child and says the same
    [verdict] = (tmp_path / "cache" / "dynamo-run" / "llamacpp-preflight").glob("*.json")
    written = verdict.stat().st_mtime_ns
    second = run_cli(args, input="And 3+3?\n", env=env, timeout=180)
    assert second.returncode == 0 and second.stdout.strip(), second.stderr
    assert sigill_lines(second.stderr) == [line]
    assert verdict.stat().st_mtime_ns == written


@pytest.mark.parametrize("mode", ["in=text", "in=dyn://ns.backend.generate"])
def test_a_library_that_cannot_decode_is_one_line_and_a_failed_start(model: Path, tmp_path: Path, mode: str):
    env = {**native_fault_env(tmp_path, "always"), "DYN_FILE_KV": str(tmp_path / "store"),
           "ETCD_ENDPOINTS": "", "NATS_SERVER": ""}
    done = run_cli([mode, "out=llamacpp", str(model), "--context-length", "512"], input="What is 2+2?\n",
                   env=env, timeout=180)
    assert done.returncode != 0
    assert done.stdout.strip() == ""
    errors = [x for x in done.stderr.splitlines() if x.startswith("Error:")]
    assert len(errors) == 1, done.stderr
    assert "dies of SIGILL (Illegal instruction)" in errors[0] and "libggml-cpu" in errors[0], errors[0]
    assert FIX in errors[0] and "running without them" not in errors[0]
    assert "Traceback" not in done.stderr and "Fatal Python error" not in done.stderr
    # the worker never registered: nothing in the store names it
    store = tmp_path / "store"
    assert not store.exists() or not any("instances" in str(p) for p in store.rglob("*") if p.is_file())
