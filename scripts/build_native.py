"""Build the C extensions listed in pyproject.toml ([[tool.setuptools.ext-modules]]) in place, under src/.

``pip install -e .`` builds them too (scripts/setup-venv.sh); this is for a checkout that runs from
``PYTHONPATH=src`` with a virtualenv it does not own (a git worktree borrowing another checkout's .venv),
whose setuptools may be older than the one pyproject.toml's build needs.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

from setuptools import Distribution, Extension

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    specs = config["tool"]["setuptools"].get("ext-modules", [])
    exts = [Extension(s["name"], [str(ROOT / p) for p in s["sources"]],
                      depends=[str(ROOT / p) for p in s.get("depends", [])],
                      extra_compile_args=s.get("extra-compile-args", [])) for s in specs]
    dist = Distribution({"name": "dynamo-run-native", "ext_modules": exts, "package_dir": {"": str(ROOT / "src")}})
    cmd = dist.get_command_obj("build_ext")
    cmd.inplace = True  # type: ignore[attr-defined]
    cmd.build_temp = str(ROOT / "build" / "native")  # type: ignore[attr-defined]
    dist.run_command("build_ext")
    return 0


if __name__ == "__main__":
    sys.exit(main())
