#!/usr/bin/env python3
"""Fails when a module of src/ uses a module of a higher layer.

The layers are the table of ARCHITECTURE.md (| rank | layer | folder |
modules |, under its drawing): each layer is a folder of src/ (a
top-level module), and its row lists the modules in that folder, which
must be exactly those there. A `crate::` path (`use crate::records::ledger`,
`crate::infra::db::Tx`, `use crate::{infra::db, edge::http}`) in a
folder's files may name only folders of its own rank or lower. Prints
each arrow that runs back up, and each row that says other than the
folder holds; run by `make lint`.
"""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "ARCHITECTURE.md"
ROW = re.compile(r"^\|\s*(\d+)\s*\|[^|]*\|\s*`?([a-z_]+)/?`?\s*\|\s*([a-z_, ]*?)\s*\|\s*$")
PATHS = re.compile(r"\bcrate::(?:\{([^}]*)\}|([a-z_]+))")


def main():
    rank = {}
    listed = {}
    for line in DOC.read_text().splitlines():
        match = ROW.match(line)
        if match:
            rank[match.group(2)] = int(match.group(1))
            listed[match.group(2)] = {m.strip() for m in match.group(3).split(",") if m.strip()}
    if not rank:
        sys.exit("layers: ARCHITECTURE.md has no table of layers")
    problems = []
    modules = {p.stem if p.is_file() else p.name for p in (ROOT / "src").iterdir()}
    for module in sorted(modules - {"lib"}):
        if module not in rank:
            problems.append(f"src/{module}: in no layer of ARCHITECTURE.md's table")
            continue
        if listed[module] == {module}:
            continue  # a layer of one module (issuance, main) is its own row
        folder = ROOT / "src" / module
        held = {p.stem if p.is_file() else p.name for p in folder.iterdir()} if folder.is_dir() else set()
        if held != listed[module]:
            problems.append(
                f"src/{module}/ holds {', '.join(sorted(held)) or 'no module folder'}; "
                f"ARCHITECTURE.md lists {', '.join(sorted(listed[module])) or 'none'}"
            )
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
        print("layers: ARCHITECTURE.md's table and src/ disagree:", file=sys.stderr)
        print("\n".join(f"  {p}" for p in problems), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
