"""Does the installed llama.cpp decode on this CPU?  Asked in a child process, once per library build,
model file and CPU, before the engine loads the model in its own process.

Why a child: llama-cpp-python compiles llama.cpp for the CPU it is built on.  On cloud VMs whose Xeon
advertises AMX (a Sapphire Rapids guest under Firecracker, measured), ggml's AMX kernels trap at their first
``tilezero``: the process dies of SIGILL and the user reads one word, "Illegal instruction", before the first
token.  A signal cannot be caught in Python after native code trapped, so the only place to turn it into a
sentence is a parent.  The child loads the model with the engine's own loader (model.py), decodes a prompt of
64 tokens (the AMX kernels run only for prompts, not single-token steps) and one more token.

* it dies of a signal: the child runs again without llama.cpp's extra buffer types (``use_extra_bufts``:
  the repacked AMX/AVX-512 weight layouts; every AMX kernel runs through them).  If that decodes, the engine
  runs that way and says so in one warning line naming the signal, the library file and the fix; if that dies
  too, :func:`require` raises one line with the same facts and nothing is loaded in-process.
* it fails without a signal (a corrupt model, out of memory, a time-out): no verdict; the in-process load
  reports its own error as before.

Verdicts are cached in ``$XDG_CACHE_HOME/dynamo-run/llamacpp-preflight/`` under a key made of the library
files' SHA-256, the CPU's flags and the model file's identity (path, size, mtime), so a rebuilt library or a
new CPU is asked again and a later start pays only the hashing.  ``DYN_LLAMACPP_PREFLIGHT=0`` skips the check.
The cost, measured (docs/engines.md): about a second once per model and build (SmolLM2-135M); about 30 ms of
hashing on later starts.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from dynamo.errors import UserError

log = logging.getLogger(__name__)

PROMPT_TOKENS = 64  # a prompt this long takes ggml's batched (AMX) matmul path
TIMEOUT_S = 300.0  # a child still loading after this long gives no verdict (a huge model on a slow disk)
FATAL_SIGNALS = {signal.SIGILL: "Illegal instruction", signal.SIGSEGV: "Segmentation fault",
                 signal.SIGBUS: "Bus error", signal.SIGFPE: "Floating-point exception"}
# CPU features a native llama.cpp build compiles for, as /proc/cpuinfo names them: the ones a trap names
CPU_FEATURES = ("amx_tile", "amx_int8", "amx_bf16", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "avx2")
REBUILD = "scripts/setup-venv.sh --rebuild-llamacpp"  # the command that rebuilds it for this CPU


@dataclass
class Verdict:
    """``decodes``: the library decodes here at all; ``extra_bufts``: with its extra buffer types (the
    default, and the fast path); ``failure``: what died, one line (None when everything decodes)."""

    decodes: bool
    extra_bufts: bool
    failure: str | None = None


def library_dir() -> Path | None:
    """Where llama-cpp-python loads its shared libraries from (its ``LLAMA_CPP_LIB_PATH`` first)."""
    env = os.environ.get("LLAMA_CPP_LIB_PATH")
    if env:
        return Path(env)
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "lib"


def library_files() -> list[Path]:
    d = library_dir()
    if d is None or not d.is_dir():
        return []
    return sorted(p for p in d.iterdir()
                  if p.is_file() and not p.is_symlink() and (".so" in p.name or p.suffix in (".dylib", ".dll")))


def cpu_library() -> Path | None:
    """ggml's CPU backend, where the kernels that trap live (the file a crash names)."""
    files = library_files()
    return next((p for p in files if p.name.startswith("libggml-cpu")), files[0] if files else None)


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cache_key(model: Path) -> str:
    h = hashlib.sha256()
    for p in library_files():
        h.update(p.name.encode())
        with open(p, "rb") as f:
            h.update(hashlib.file_digest(f, "sha256").digest())
    h.update(" ".join(sorted(cpu_flags())).encode())
    st = model.stat()
    h.update(f"{model.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()[:32]


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dynamo-run" / "llamacpp-preflight"


def describe(sig: int, *, extra_bufts_ok: bool) -> str:
    """One line: what died, of which signal, on which CPU features, and the command that fixes it."""
    name = FATAL_SIGNALS.get(signal.Signals(sig), signal.Signals(sig).name)
    lib = cpu_library()
    features = [f for f in CPU_FEATURES if f in cpu_flags()]
    what = (f"llama.cpp's CPU library {lib or '(llama_cpp)'} dies of {signal.Signals(sig).name} ({name}) on this CPU "
            f"({' '.join(features) or 'no AVX2'})")
    if extra_bufts_ok:
        what += " in the kernels of its extra buffer types (AMX, repacked weights): running without them"
    return (f"{what}; rebuild it for this machine: {REBUILD} "
            "(or pip install --force-reinstall --no-cache-dir llama-cpp-python with the CMAKE_ARGS of README.md)")


def decode_in_child(model: Path, *, extra_bufts: bool, timeout: float = TIMEOUT_S) -> int | None:
    """The child's exit status: 0 decoded, a negative signal number, a positive error; None: timed out."""
    cmd = [sys.executable, "-m", "dynamo.engines.llamacpp.preflight", "decode", str(model)]
    if not extra_bufts:
        cmd.append("--no-extra-bufts")
    try:
        done = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    if done.returncode > 0:
        log.debug("llama.cpp preflight of %s failed (%d): %s", model, done.returncode,
                  done.stderr.decode(errors="replace").strip()[-500:])
    return done.returncode


def check(model: Path) -> Verdict | None:
    """The verdict for ``model`` on the installed library (cached); None: no verdict (see the module doc)."""
    if os.environ.get("DYN_LLAMACPP_PREFLIGHT", "1") == "0" or not library_files() or not model.is_file():
        return None
    t0 = time.monotonic()
    key = cache_key(model)
    cached = cache_dir() / f"{key}.json"
    try:
        return Verdict(**json.loads(cached.read_text()))
    except (OSError, ValueError, TypeError):
        pass
    rc = decode_in_child(model, extra_bufts=True)
    if rc == 0:
        verdict = Verdict(decodes=True, extra_bufts=True)
    elif rc is not None and rc < 0 and -rc in FATAL_SIGNALS:  # an abort (an assertion) is no verdict
        rc2 = decode_in_child(model, extra_bufts=False)
        if rc2 is None or rc2 > 0:
            return None
        verdict = Verdict(decodes=rc2 == 0, extra_bufts=False, failure=describe(-rc, extra_bufts_ok=rc2 == 0))
    else:
        return None
    log.debug("llama.cpp preflight of %s: %s in %.2f s", model.name, verdict, time.monotonic() - t0)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(verdict)))
        tmp.replace(cached)
    except OSError as e:
        log.debug("llama.cpp preflight verdict not cached: %s", e)
    return verdict


def require(model: Path) -> bool:
    """Whether to load ``model`` with the extra buffer types; raises UserError (one line) when the library
    cannot decode on this CPU at all."""
    verdict = check(model)
    if verdict is None:
        return True
    if not verdict.decodes:
        raise UserError(verdict.failure or "llama.cpp cannot decode on this CPU")
    if not verdict.extra_bufts:
        log.warning("%s", verdict.failure)
    return verdict.extra_bufts


# -- the child ---------------------------------------------------------------------------------------
def decode(model_path: Path, *, extra_bufts: bool) -> None:
    """Load the model as the engine does, decode a 64-token prompt and one sampled token."""
    from dynamo.engines.llamacpp import model

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    llama = model.load(model_path, n_parallel=1, n_ctx_seq=2 * PROMPT_TOKENS, n_batch=PROMPT_TOKENS,
                       n_ubatch=PROMPT_TOKENS, n_gpu_layers=0, threads=cores, threads_batch=None, type_k=None,
                       type_v=None, flash_attn=None, verbose=False, use_extra_bufts=extra_bufts)
    L, batch = llama.L, llama.batch

    def step(ids: list[int], start: int) -> int:
        batch.n_tokens = len(ids)
        for i, tok in enumerate(ids):
            batch.token[i] = tok
            batch.pos[i] = start + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = i == len(ids) - 1
        if L.llama_decode(llama.lctx, batch) != 0:
            raise SystemExit("llama_decode failed")
        logits = llama.np.ctypeslib.as_array(L.llama_get_logits_ith(llama.lctx, -1), shape=(llama.n_vocab,))
        return int(logits.argmax())

    token = step([1 + i % max(1, llama.n_vocab - 1) for i in range(PROMPT_TOKENS)], 0)
    step([token], PROMPT_TOKENS)
    model.free(llama)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m dynamo.engines.llamacpp.preflight",
                                description="Check that the installed llama.cpp decodes MODEL on this CPU.")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("decode", help="(the child) load MODEL and decode 65 tokens in this process")
    d.add_argument("model", type=Path)
    d.add_argument("--no-extra-bufts", action="store_true")
    c = sub.add_parser("check", help="the verdict, from a child process; exit 0: decodes with every kernel, "
                       "1: only without the repacked kernels, 3: not at all")
    c.add_argument("model", type=Path)
    c.add_argument("--fresh", action="store_true", help="ignore a cached verdict")
    args = p.parse_args(argv)
    if args.cmd == "decode":
        decode(args.model, extra_bufts=not args.no_extra_bufts)
        return
    if args.fresh:
        for f in cache_dir().glob(f"{cache_key(args.model)}.json"):
            f.unlink()
    verdict = check(args.model)
    if verdict is None:
        print(f"llama.cpp preflight of {args.model}: no verdict (not installed, or the model does not load)")
        raise SystemExit(2)
    print(verdict.failure or f"llama.cpp decodes {args.model.name} on this CPU ({library_dir()})")
    raise SystemExit(0 if verdict.extra_bufts else 1 if verdict.decodes else 3)


if __name__ == "__main__":
    main()
