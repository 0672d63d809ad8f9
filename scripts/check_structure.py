"""Structure checks that ruff, mypy and import-linter do not make, run by scripts/lint.sh:

- no module of ``src/dynamo`` over 700 lines (a bigger one has more than one job: split it by job);
- no ``_private`` name imported from another module (make it public where it is shared, or move the code).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

MAX_LINES = 700
ROOT = Path(__file__).resolve().parents[1] / "src" / "dynamo"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def main() -> int:
    problems = []
    for path in sorted(ROOT.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        lines = text.count("\n")
        rel = path.relative_to(ROOT.parents[1])
        if lines > MAX_LINES:
            problems.append(f"{rel}: {lines} lines (at most {MAX_LINES}: split it by job)")
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level == 0 and not (node.module or "").startswith("dynamo"):
                continue  # other projects' private names are their business (and a comment's)
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    source = "." * node.level + (node.module or "")
                    problems.append(f"{rel}:{node.lineno}: imports the private name {alias.name} from {source}")
    for problem in problems:
        print(problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
