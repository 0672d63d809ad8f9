"""A llama.cpp that dies of SIGILL, on any machine: for the tests of what the user reads when the engine's
native library traps (engines/llamacpp/preflight.py).

A real trap needs a CPU and a compiler that build one (GCC 12 on an AMX Xeon does: scripts/
llamacpp_cmake_args.py), so the tests inject it instead: a ``sitecustomize`` module, on the child's
PYTHONPATH, wraps llama-cpp-python's ``llama_model_load_from_file`` and ``llama_decode`` and sends the
process a real SIGILL from inside ``llama_decode``, as a trapping kernel would.  Everything around it (the
preflight child, its verdict and cache, the engine's fallback, the CLI's error line, the frontend's view of
a dead worker) is the real code.  Modes (``DYN_TEST_NATIVE_FAULT``):

* ``extra_bufts``: dies only when the model's weights are in llama.cpp's extra buffer types (the default;
  what GCC 12's miscompiled AMX kernels do);
* ``always``: every decode dies;
* ``after:N``: the process's decodes after the first N die (a worker that passes the preflight, whose
  child decodes twice, and dies while serving).
"""

from __future__ import annotations

import os
from pathlib import Path

SITECUSTOMIZE = '''
import os, signal
MODE = os.environ.get("DYN_TEST_NATIVE_FAULT", "")
if MODE:
    import llama_cpp as L
    _load, _decode = L.llama_model_load_from_file, L.llama_decode
    state = {"extra_bufts": True, "decodes": 0}

    def llama_model_load_from_file(path, params):
        state["extra_bufts"] = bool(params.use_extra_bufts)
        return _load(path, params)

    def llama_decode(ctx, batch):
        state["decodes"] += 1
        if (MODE == "always" or (MODE == "extra_bufts" and state["extra_bufts"])
                or (MODE.startswith("after:") and state["decodes"] > int(MODE[6:]))):
            os.kill(os.getpid(), signal.SIGILL)
        return _decode(ctx, batch)

    L.llama_model_load_from_file, L.llama_decode = llama_model_load_from_file, llama_decode
'''


def native_fault_env(tmp: Path, mode: str) -> dict[str, str]:
    """The environment of a process (and its children) whose llama.cpp dies as ``mode`` says; the preflight's
    verdicts go to a cache of their own under ``tmp``."""
    site = tmp / "native-fault-site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "DYN_TEST_NATIVE_FAULT": mode, "XDG_CACHE_HOME": str(tmp / "cache")}
