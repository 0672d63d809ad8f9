#!/usr/bin/env python3
"""llama.cpp builds side by side: the same model, the same ``llama_decode`` calls, another shared library.

    .venv/bin/python -m benchmarks.llamacpp_builds --lib avx2=DIR --lib amx=DIR [--repeat 3] [--out FILE]

Each ``--lib NAME=DIR`` is a folder of llama-cpp-python shared libraries (``llama_cpp/lib`` of a wheel built
with other CMAKE_ARGS; llama-cpp-python loads it through ``LLAMA_CPP_LIB_PATH``); the installed library is
always measured first, as ``installed``, and is the anchor every ratio is against.  Each build runs
benchmarks/llamacpp_inprocess.py's ``raw_decode`` in a child process (decode steps of 1 and 8 sequences,
and their prompts of ``--prompt`` tokens each in one batch: 8 x 64 = 512 tokens by default, where ggml's
AMX kernels run), builds interleaved ``--repeat`` times so that a busy moment of the machine does not fall
on one build; medians and the spread (min-max) over the repeats are printed.

How to build the other libraries (a wheel each, nothing installed; 7 minutes each on 2 cores)::

    CMAKE_ARGS="$(python3 scripts/llamacpp_cmake_args.py | sed 's/AVX512\\([A-Z0-9_]*\\)=ON/AVX512\\1=OFF/g')" \\
      .venv/bin/pip wheel --no-deps --no-cache-dir --no-binary llama-cpp-python -w /tmp/avx2 llama-cpp-python==0.3.36
    unzip -q /tmp/avx2/*.whl 'llama_cpp/lib/*' -d /tmp/avx2      # then --lib avx2=/tmp/avx2/llama_cpp/lib
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks import machine
from harness.smollm2 import smollm2_gguf_or_exit

CHILD = """
import json, sys
from pathlib import Path
from benchmarks.llamacpp_inprocess import raw_decode
print(json.dumps(raw_decode(Path(sys.argv[1]), [1, 8], [int(sys.argv[2])], reps=1, steps=int(sys.argv[3]),
                            prompt=int(sys.argv[4]))))
"""


def run_build(lib: Path | None, gguf: Path, threads: int, steps: int, prompt: int) -> dict[str, Any]:
    env = dict(os.environ)
    env.pop("LLAMA_CPP_LIB_PATH", None)
    if lib is not None:
        env["LLAMA_CPP_LIB_PATH"] = str(lib)
    done = subprocess.run([sys.executable, "-c", CHILD, str(gguf), str(threads), str(steps), str(prompt)],
                          capture_output=True, text=True, env=env, cwd=machine.REPO, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"build {lib or 'installed'}: exit {done.returncode}: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lib", action="append", default=[], metavar="NAME=DIR", help="another build's library folder")
    ap.add_argument("--gguf", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--steps", type=int, default=32, help="decode steps per measurement")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens per sequence")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    gguf = a.gguf or smollm2_gguf_or_exit()
    builds: dict[str, Path | None] = {"installed": None}
    for spec in a.lib:
        name, _, path = spec.partition("=")
        builds[name] = Path(path)
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name in builds}
    for _ in range(a.repeat):
        for name, lib in builds.items():
            samples[name].append(run_build(lib, gguf, a.threads, a.steps, a.prompt))
    metrics = [("decode tok/s, 1 seq", "batch=1", "decode_tokens_per_s"),
               ("decode tok/s, 8 seqs", "batch=8", "decode_tokens_per_s"),
               (f"prefill tok/s, 8 x {a.prompt}", "batch=8", "prefill_tokens_per_s"),
               (f"prefill tok/s, 1 x {a.prompt}", "batch=1", "prefill_tokens_per_s")]
    summary: dict[str, dict[str, Any]] = {}
    for name in builds:
        summary[name] = {}
        for label, batch, key in metrics:
            values = [s[f"threads={a.threads} {batch}"][key] for s in samples[name]]
            summary[name][label] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    rows = [["build", *[m[0] for m in metrics]]]
    for name in builds:
        cells = [name]
        for label, _, _ in metrics:
            s, anchor = summary[name][label], summary["installed"][label]["median"]
            cells.append(f"{s['median']:.0f} ({s['min']:.0f}-{s['max']:.0f}) {s['median'] / anchor:.2f}x")
        rows.append(cells)
    print(machine.text_table(rows))
    if a.out:
        a.out.write_text(json.dumps({"machine": machine.describe(), "threads": a.threads, "repeat": a.repeat,
                                     "builds": {k: str(v) if v else "installed" for k, v in builds.items()},
                                     "summary": summary, "samples": samples}, indent=1))


if __name__ == "__main__":
    main()
