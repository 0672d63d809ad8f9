#!/usr/bin/env python3
"""Print the CMAKE_ARGS that build llama.cpp (llama-cpp-python) for the instruction sets that really run here.

Why not ggml's GGML_NATIVE: it compiles for every feature the CPU advertises, and one of them can be built
into code that traps.  Measured on an AMX Xeon (Sapphire Rapids) with Debian 12's GCC 12.2: GCC 12's
``_tile_loadconfig`` declares an 8-byte memory operand, so at -O2 and above the stores of the tile rows and
columns before it are eliminated, ggml loads an empty tile configuration, and its first ``tilezero`` dies of
SIGILL ("Illegal instruction" before the first token of any prompt longer than a few tokens).  The
elimination is dead-store elimination: with ``-fno-dse -fno-tree-dse`` GCC 12 keeps the stores and the AMX
kernels run (and give the same greedy tokens as the build without them), so where the plain AMX probe dies and
that one runs, AMX stays on and those two flags go into CMAKE_C_FLAGS / CMAKE_CXX_FLAGS for the whole
build.  Measured on that Xeon (benchmarks/llamacpp_builds.py, SmolLM2 Q4_1, 2 threads): 1.9-2.9x the
decode tokens/s of the build without AMX, 4.5x its prompt tokens/s (docs/engines.md).

So each ggml option is proven the way the build will use it: the CPU lists the feature in /proc/cpuinfo,
and a tiny program using that feature's instructions, compiled with the build's C++ compiler ($CXX, else
c++) at -O3 with ggml's flags for it, runs to completion.  The AMX program is ggml's own pattern (a tile
configuration in a struct with default member initialisers, filled field by field, then loaded), so a
compiler that miscompiles it, even without dead-store elimination, turns AMX off; AVX-512, VNNI and BF16
stay on where they run.  Every option is then passed explicitly with GGML_NATIVE=OFF.  Off x86 the native
build is kept (nothing there traps so).

    scripts/llamacpp_cmake_args.py            # the CMAKE_ARGS, one line
    scripts/llamacpp_cmake_args.py --explain  # and, on stderr, each feature's verdict
    scripts/llamacpp_cmake_args.py --no-amx   # the same without AMX
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# ggml option -> (/proc/cpuinfo flags, compiler flags, the body of main() that uses them)
PROBES: dict[str, tuple[tuple[str, ...], tuple[str, ...], str]] = {
    "SSE42": (("sse4_2",), ("-msse4.2",), "v.u = _mm_crc32_u32(v.u, 7u);"),
    "AVX": (("avx",), ("-mavx",),
            "__m256 a = _mm256_set1_ps(v.f); a = _mm256_add_ps(a, a); v.f = _mm256_cvtss_f32(a);"),
    "AVX2": (("avx2",), ("-mavx2",),
             "__m256i a = _mm256_set1_epi32(v.i); a = _mm256_add_epi32(a, a); v.i = _mm256_extract_epi32(a, 3);"),
    "FMA": (("fma",), ("-mfma",),
            "__m256 a = _mm256_set1_ps(v.f); a = _mm256_fmadd_ps(a, a, a); v.f = _mm256_cvtss_f32(a);"),
    "F16C": (("f16c",), ("-mf16c",),
             "__m128 a = _mm_cvtph_ps(_mm_set1_epi16((short)v.i)); v.f = _mm_cvtss_f32(a);"),
    "BMI2": (("bmi2",), ("-mbmi2",), "v.u = _pdep_u32(v.u, 0x5555u);"),
    "AVX_VNNI": (("avx_vnni",), ("-mavx2", "-mavxvnni"),
                 "__m256i a = _mm256_set1_epi32(v.i); a = _mm256_dpbusd_avx_epi32(a, a, a);"
                 " v.i = _mm256_extract_epi32(a, 1);"),
    "AVX512": (("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),
               ("-mavx512f", "-mavx512cd", "-mavx512vl", "-mavx512dq", "-mavx512bw"),
               "__m512i a = _mm512_set1_epi8((char)v.i); a = _mm512_abs_epi8(a);"
               " v.i = _mm_cvtsi128_si32(_mm512_castsi512_si128(a));"),
    "AVX512_VBMI": (("avx512vbmi",), ("-mavx512f", "-mavx512vbmi"),
                    "__m512i a = _mm512_set1_epi32(v.i); a = _mm512_permutexvar_epi8(a, a);"
                    " v.i = _mm_cvtsi128_si32(_mm512_castsi512_si128(a));"),
    "AVX512_VNNI": (("avx512_vnni",), ("-mavx512f", "-mavx512vnni"),
                    "__m512i a = _mm512_set1_epi32(v.i); a = _mm512_dpbusd_epi32(a, a, a);"
                    " v.i = _mm_cvtsi128_si32(_mm512_castsi512_si128(a));"),
    "AVX512_BF16": (("avx512_bf16",), ("-mavx512f", "-mavx512bf16"),
                    "__m512 a = _mm512_set1_ps(v.f); __m512bh b = _mm512_cvtne2ps_pbh(a, a);"
                    " __m512 c = _mm512_dpbf16_ps(a, b, b); v.f = _mm512_cvtss_f32(c);"),
}
AMX_FLAGS = ("amx_tile", "amx_int8", "amx_bf16")
NO_DSE = ("-fno-dse", "-fno-tree-dse")  # keeps GCC 12 from dropping the tile configuration's stores
# ggml's AMX kernels: its tile configuration code, then an int8 and a bf16 tile product
AMX_PROGRAM = r"""
#include <immintrin.h>
#include <stdint.h>
#include <unistd.h>
#include <sys/syscall.h>
struct tile_config_t {
    uint8_t palette_id = 0; uint8_t start_row = 0; uint8_t reserved_0[14] = {0};
    uint16_t colsb[16] = {0}; uint8_t rows[16] = {0};
};
__attribute__((noinline)) static void tile_config_init() {
    alignas(64) tile_config_t tc = {};
    tc.palette_id = 1;
    for (int t = 0; t < 3; ++t) { tc.rows[t] = 16; tc.colsb[t] = 64; }
    _tile_loadconfig(&tc);
}
alignas(64) static int8_t A[16 * 64], B[16 * 64];
alignas(64) static int32_t C[16 * 16];
int main() {
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */)) return 2;
    tile_config_init();
    _tile_zero(2);
    _tile_loadd(0, A, 64);
    _tile_loadd(1, B, 64);
    _tile_dpbssd(2, 0, 1);
    _tile_dpbf16ps(2, 0, 1);
    _tile_stored(2, C, 64);
    _tile_release();
    return C[0];
}
"""


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def compiler() -> str | None:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    return cxx.split()[0] if cxx else None


def runs(cxx: str, source: str, flags: tuple[str, ...], work: Path) -> tuple[bool, str]:
    """Compile ``source`` at -O3 with ``flags`` and run it: (it ran, why not)."""
    src, exe = work / "probe.cpp", work / "probe"
    src.write_text(source)
    exe.unlink(missing_ok=True)
    build = subprocess.run([cxx, "-O3", *flags, str(src), "-o", str(exe)], capture_output=True, text=True)
    if build.returncode != 0:
        return False, "the compiler cannot build it"
    try:
        done = subprocess.run([str(exe)], capture_output=True, timeout=30)
    except subprocess.TimeoutExpired:
        return False, "the probe hung"
    if done.returncode < 0:
        return False, f"dies of signal {-done.returncode}"
    if done.returncode != 0:
        return False, f"exits {done.returncode}"
    return True, "runs"


def simple_program(body: str) -> str:
    return ("#include <immintrin.h>\n#include <stdint.h>\n"
            "static volatile union { float f; int i; unsigned u; } v = {1.5f};\n"
            f"int main() {{ {body} return v.i == 12345 ? 1 : 0; }}\n")


def verdicts(no_amx: bool) -> dict[str, tuple[bool, str]]:
    """ggml option -> (on, why)."""
    flags, cxx = cpu_flags(), compiler()
    out: dict[str, tuple[bool, str]] = {}
    with tempfile.TemporaryDirectory(prefix="llamacpp-isa-") as tmp:
        work = Path(tmp)
        for option, (needs, cflags, body) in PROBES.items():
            missing = [f for f in needs if f not in flags]
            if missing:
                out[option] = (False, f"the CPU does not list {' '.join(missing)}")
            elif cxx is None:
                out[option] = (False, "no C++ compiler")
            else:
                out[option] = runs(cxx, simple_program(body), cflags, work)
        missing = [f for f in AMX_FLAGS if f not in flags]
        if no_amx:
            amx = (False, "--no-amx")
        elif missing:
            amx = (False, f"the CPU does not list {' '.join(missing)}")
        elif not out["AVX512_VNNI"][0]:
            amx = (False, "ggml's AMX kernels need AVX512_VNNI")
        elif cxx is None:
            amx = (False, "no C++ compiler")
        else:
            amx_flags = ("-mavx512f", "-mamx-tile", "-mamx-int8", "-mamx-bf16")
            ok, why = runs(cxx, AMX_PROGRAM, amx_flags, work)
            if not ok and why.startswith("dies"):
                # the miscompilation is dead-store elimination: without it the configuration is stored
                ok2, why2 = runs(cxx, AMX_PROGRAM, amx_flags + NO_DSE, work)
                if ok2:
                    out["NO_DSE"] = (True, f"{cxx} at -O3 {why} in ggml's tile configuration; with "
                                           f"{' '.join(NO_DSE)} it runs")
                    ok, why = True, f"runs with {' '.join(NO_DSE)}"
                else:
                    why = (f"ggml's tile configuration, compiled by {cxx} at -O3, {why} (GCC 12's "
                           "_tile_loadconfig drops the configuration's stores; GCC 13+ or clang build it right)")
            amx = (ok, why)
        for option in ("AMX_TILE", "AMX_INT8", "AMX_BF16"):
            out[option] = amx
    return out


def cmake_args(no_amx: bool = False, explain: bool = False) -> str:
    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
        return "-DGGML_NATIVE=ON"
    v = verdicts(no_amx)
    no_dse = v.pop("NO_DSE", None)
    if explain:
        for option, (on, why) in v.items():
            print(f"  GGML_{option:<12} {'ON ' if on else 'OFF'}  {why}", file=sys.stderr)
        if no_dse:
            print(f"  {' '.join(NO_DSE)}  {no_dse[1]}", file=sys.stderr)
    args = ["-DGGML_NATIVE=OFF"] + [f"-DGGML_{o}={'ON' if on else 'OFF'}" for o, (on, _) in v.items()]
    if no_dse and v["AMX_INT8"][0]:
        args += [f"-DCMAKE_{lang}_FLAGS='{' '.join(NO_DSE)}'" for lang in ("C", "CXX")]
    return " ".join(args)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--no-amx", action="store_true", help="leave AMX off whatever the probe says")
    p.add_argument("--explain", action="store_true", help="print each feature's verdict on stderr")
    a = p.parse_args()
    print(cmake_args(no_amx=a.no_amx, explain=a.explain))


if __name__ == "__main__":
    main()
