#!/usr/bin/env python3
"""The map from SPEC's promises and bounds to the tests that check them.

Reads the tables of tests/README.md (| name | SPEC anchor | tests |) and
docs/SPEC.md, prints the map, and fails when:
  - an item of a mapped SPEC section (each promise; each bullet of "Limits
    and isolation" and of "High availability and operations") is named by
    no row: SPEC grew and nobody mapped it;
  - a row's anchor is no longer in SPEC (the item it names does not exist);
  - a row names a test that does not exist (or is not a test);
  - a row has no test and does not say, in words, why it waits
    ("pending: why", at least ten characters of why).
"""

import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAP = ROOT / "tests" / "README.md"
SPEC = Path(os.environ.get("SPEC", ROOT / "docs" / "SPEC.md"))

# Headings whose every item must be named by a row.
MAPPED = [
    "## Promises (each one a test)",
    "## Limits and isolation",
    "### High availability and operations",
    "## Delivery endpoints per project",
    "## Registers an auditor can verify",
]
# Headings whose items a row may name too.
NAMEABLE = MAPPED + ["## Gapless sequences", "## Security"]

ROW = re.compile(r"^\|\s*([a-z0-9-]+)\s*\|\s*`([^`]+)`\s*\|\s*(.+?)\s*\|\s*$")
TEST_REF = re.compile(r"`([^`:]+\.rs)::([A-Za-z0-9_]+)`")
PENDING = re.compile(r"^pending: .{10,}$")
TEST_ATTRIBUTE = re.compile(r"#\[(tokio::test|test|sqlx::test)\b")


def items_of(spec_lines, heading):
    """The items (a promise, a bullet) under `heading`, each as its lines,
    and its other paragraphs (which a row may name, and none must)."""
    try:
        start = spec_lines.index(heading) + 1
    except ValueError:
        sys.exit(f"spec-map: SPEC has no heading {heading!r}")
    level = heading.split(" ")[0]
    items, paragraphs = [], []
    for line in spec_lines[start:]:
        if line.startswith("#") and len(line.split(" ")[0]) <= len(level):
            break
        if re.match(r"^(- |\d+\. )", line):
            items.append([line])
        elif items and items[-1] and line.startswith(" ") and line.strip():
            items[-1].append(line)
        elif not line.strip():
            items.append(None)  # a blank line ends the item
        else:
            paragraphs.append([line])
    return [item for item in items if item], paragraphs


def is_test(path, name):
    """Whether `path` defines `fn name` as a test."""
    file = ROOT / path
    if not file.is_file():
        return False
    lines = file.read_text().splitlines()
    for i, line in enumerate(lines):
        if re.search(rf"\bfn {re.escape(name)}\s*[(<]", line):
            above = lines[max(0, i - 8) : i]
            in_proptest = any("proptest!" in l for l in lines[max(0, i - 200) : i])
            if any(TEST_ATTRIBUTE.search(l) for l in above) or in_proptest:
                return True
    return False


def main():
    if not SPEC.is_file():
        sys.exit(f"spec-map: {SPEC} not found (SPEC=path to set it)")
    spec_lines = SPEC.read_text().splitlines()
    rows = []
    for n, line in enumerate(MAP.read_text().splitlines(), 1):
        match = ROW.match(line)
        if match:
            rows.append((n, *match.groups()))
    errors = []
    names = set()
    parts = {h: items_of(spec_lines, h) for h in NAMEABLE}
    nameable = {h: items for h, (items, _) in parts.items()}
    nameable.update({f"{h} (text)": text for h, (_, text) in parts.items()})
    named_items = set()
    for n, name, anchor, tests in rows:
        where = f"tests/README.md:{n} {name}"
        if name in names:
            errors.append(f"{where}: named twice")
        names.add(name)
        found = [
            (heading, i)
            for heading, items in nameable.items()
            for i, item in enumerate(items)
            if any(anchor in line for line in item)
        ]
        if not found:
            errors.append(f"{where}: no SPEC item says `{anchor}`")
        named_items.update(found)
        refs = TEST_REF.findall(tests)
        if not refs and not PENDING.match(tests):
            errors.append(f"{where}: no test (and no \"pending: why\")")
        for path, test in refs:
            if not is_test(path, test):
                errors.append(f"{where}: {path}::{test} is not a test")
    for heading in MAPPED:
        for i, item in enumerate(nameable[heading]):
            if (heading, i) not in named_items:
                errors.append(f"SPEC {heading!r}: no row names {item[0].strip()[:70]!r}")

    width = max(len(name) for _, name, _, _ in rows)
    for _, name, _, tests in [] if "--quiet" in sys.argv else rows:
        refs = TEST_REF.findall(tests)
        said = f"{len(refs)} test{'s' if len(refs) != 1 else ''}" if refs else tests[:60]
        print(f"{name:<{width}}  {said}")
    pending = sum(1 for row in rows if PENDING.match(row[3]))
    print(
        f"spec-map: {len(rows)} items named, {len(rows) - pending} with tests, "
        f"{pending} pending"
    )
    if errors:
        print("\n".join(errors), file=sys.stderr)
        sys.exit(f"spec-map: {len(errors)} problems")


if __name__ == "__main__":
    main()
