#!/usr/bin/env python3
"""Fails when ARCHITECTURE.md names code that does not exist.

Every `backticked` token of ARCHITECTURE.md that reads as code is looked
up in the repository:
  - a path (`issuance/pipeline.rs`, `lease/`, `migrations/`, `handouts.rs`):
    a file or folder under src/, tests/api/, bench/src/ or the root; a bare
    file name may be anywhere under src/;
  - `Type::item` or `module::item` (`Issuer::issue`, `db::once_answering`,
    `ledger::outbox::DocumentView`, `answers::a_stalled_…`): `item` is
    defined (fn, struct, enum, trait, type, const, static, mod or enum
    variant) in the module `module`, or in a file that declares or
    implements `Type`; a path into a dependency (`sqlx::Error`) is not
    looked up.
Prints what it could not find and exits 1; run by `make lint`.
"""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "ARCHITECTURE.md"
SOURCES = [p for d in ("src", "tests", "bench/src", "examples") for p in (ROOT / d).rglob("*.rs")]
PATH = re.compile(r"[a-z_]+(/[a-z_]+)*(\.rs|/)?")
SYMBOL = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(::[A-Za-z_][A-Za-z0-9_]*)+")
ROOTS = ["src", "tests/api", "bench/src", "."]


def defines(text, name):
    """Whether `text` defines `name` (an item, or an enum variant)."""
    item = rf"\b(fn|struct|enum|trait|type|const|static|mod|macro_rules!)\s+{re.escape(name)}\b"
    variant = rf"^\s*{re.escape(name)}\s*(\(|\{{|,|$)"
    return re.search(item, text) or re.search(variant, text, re.MULTILINE)


def is_home(path, text, owner):
    """Whether `path` is module `owner`, or defines or implements type
    `owner` (where its items are)."""
    if owner[0].islower():
        return path.stem == owner or owner in path.parent.parts
    declared = rf"\b(struct|enum|trait|type)\s+{re.escape(owner)}\b"
    implemented = rf"\bimpl\b[^{{;]*\b{re.escape(owner)}\b[^{{;]*\{{"
    return re.search(declared, text) or re.search(implemented, text)


def main():
    texts = {path: path.read_text() for path in SOURCES}
    # Our dependencies' paths (`sqlx::Error`) are theirs to keep.
    manifest = (ROOT / "Cargo.toml").read_text()
    crates = {
        name.replace("-", "_")
        for name in re.findall(r"^([A-Za-z0-9_-]+)\s*=", manifest, re.MULTILINE)
    }
    missing = []
    for token in sorted(set(re.findall(r"`([^`\s]+)`", DOC.read_text()))):
        if PATH.fullmatch(token) and ("/" in token or token.endswith(".rs")):
            bare = token.rstrip("/")
            found = any((ROOT / r / bare).exists() for r in ROOTS)
            if not found:
                # Named from within its folder (`outbox/listing.rs` under
                # documents/): any source path ending so.
                found = any(
                    str(p).endswith(f"/{bare}") or f"/{bare}/" in str(p) for p in SOURCES
                )
            if not found and not bare.endswith(".rs"):
                found = any((ROOT / r / f"{bare}.rs").exists() for r in ROOTS)
            if not found:
                missing.append(f"`{token}`: no such file or folder")
        elif SYMBOL.fullmatch(token):
            *owners, item = token.split("::")
            if owners[0] in crates:
                continue
            owner = owners[-1]
            homes = [path for path, text in texts.items() if is_home(path, text, owner)]
            if not homes:
                missing.append(f"`{token}`: no module or type `{owner}`")
            elif not any(defines(texts[path], item) for path in homes):
                missing.append(f"`{token}`: `{owner}` defines no `{item}`")
    if missing:
        print("ARCHITECTURE.md names code that does not exist:", file=sys.stderr)
        print("\n".join(f"  {m}" for m in missing), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
