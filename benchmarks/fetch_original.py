#!/usr/bin/env python3
"""Fetch the ORIGINAL dynamo-run binary (Rust) for comparison benchmarks.

Downloads the `ai-dynamo==0.3.2` wheel with `pip download --no-deps` (the wheel is
never installed: its `dynamo` package would clash with ours) and extracts only
`dynamo/sdk/cli/bin/dynamo-run` into `benchmarks/.original/dynamo-run`.

Usage: python -m benchmarks.fetch_original [--cache-dir DIR] [--force]
Prints the path of the binary.
"""
from __future__ import annotations

import argparse
import os
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PACKAGE = "ai-dynamo==0.3.2"
MEMBER = "dynamo/sdk/cli/bin/dynamo-run"
DEFAULT_DEST = HERE / ".original" / "dynamo-run"
DEFAULT_CACHE = HERE / ".original" / "wheels"


def fetch(dest: Path = DEFAULT_DEST, cache_dir: Path = DEFAULT_CACHE, force: bool = False) -> Path:
    if dest.exists() and os.access(dest, os.X_OK) and not force:
        return dest
    cache_dir.mkdir(parents=True, exist_ok=True)
    wheels = sorted(cache_dir.glob("ai_dynamo-0.3.2-*.whl"))
    if not wheels or force:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
             PACKAGE, "-d", str(cache_dir)],
            check=True,
        )
        wheels = sorted(cache_dir.glob("ai_dynamo-0.3.2-*.whl"))
    if not wheels:
        raise SystemExit(f"no ai_dynamo-0.3.2 wheel found in {cache_dir}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".tmp")
    with zipfile.ZipFile(wheels[-1]) as zf:
        with zf.open(MEMBER) as src, open(tmp, "wb") as out:
            while chunk := src.read(1 << 20):
                out.write(chunk)
    tmp.chmod(tmp.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    tmp.replace(dest)
    return dest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dest", type=Path, default=DEFAULT_DEST)
    ap.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--force", action="store_true", help="re-download and re-extract")
    args = ap.parse_args()
    print(fetch(args.dest, args.cache_dir, args.force))


if __name__ == "__main__":
    main()
