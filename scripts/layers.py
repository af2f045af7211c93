#!/usr/bin/env python3
"""Fails when a module of src/ uses a module of a higher layer.

The layers are the table of ARCHITECTURE.md (| rank | layer | modules |,
under its drawing). Every top-level module of src/ must be in one row;
a `crate::` path (`use crate::ledger`, `crate::pool::Placement`,
`use crate::{db, http}`) in a module's files may name only modules of
its own rank or lower. Prints each arrow that runs back up; run by
`make lint`.
"""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "ARCHITECTURE.md"
ROW = re.compile(r"^\|\s*(\d+)\s*\|[^|]*\|\s*([a-z_, ]+?)\s*\|\s*$")
PATHS = re.compile(r"\bcrate::(?:\{([^}]*)\}|([a-z_]+))")


def main():
    rank = {}
    for line in DOC.read_text().splitlines():
        match = ROW.match(line)
        if match:
            for module in match.group(2).split(","):
                rank[module.strip()] = int(match.group(1))
    if not rank:
        sys.exit("layers: ARCHITECTURE.md has no table of layers")
    problems = []
    modules = {p.stem if p.is_file() else p.name for p in (ROOT / "src").iterdir()}
    for module in sorted(modules - {"lib"}):
        if module not in rank:
            problems.append(f"src/{module}: in no layer of ARCHITECTURE.md's table")
    for path in sorted((ROOT / "src").rglob("*.rs")):
        module = path.relative_to(ROOT / "src").parts[0].removesuffix(".rs")
        if module == "lib" or module not in rank:
            continue
        text = path.read_text()
        for match in PATHS.finditer(text):
            names = (match.group(1) or match.group(2)).split(",")
            for name in names:
                used = name.strip().split("::")[0].strip()
                if used in rank and rank[used] > rank[module]:
                    line = text.count("\n", 0, match.start()) + 1
                    problems.append(
                        f"{path.relative_to(ROOT)}:{line}: {module} (layer {rank[module]}) "
                        f"uses {used} (layer {rank[used]})"
                    )
    if problems:
        print("layers: arrows that run back up:", file=sys.stderr)
        print("\n".join(f"  {p}" for p in problems), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
