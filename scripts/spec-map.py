#!/usr/bin/env python3
"""The map from SPEC's promises and bounds to the tests that check them.

Reads the tables of tests/README.md (| name | SPEC anchor | tests |) and
docs/SPEC.md, prints the map, and fails when:
  - an item of a mapped SPEC section (each promise; each bullet of "Limits
    and isolation" and of "High availability and operations") is named by
    no row: SPEC grew and nobody mapped it;
  - a row's anchor is no longer in SPEC (the item it names does not exist);
  - a row names a test that does not exist (or is not a test);
  - a row's test does not assert what the row says it asserts: every test
    is named as `path::test` asserts `code`, and `code` (whitespace aside;
    `\|` for `|`) must stand in that test's body inside an assertion: the
    arguments of an assert macro, `panic!`, a waiting helper that fails the
    test (`eventually`, `until`), or a helper of the tests that asserts
    itself;
  - a row has no test and does not say, in words, why it waits
    ("pending: why", at least ten characters of why).
"""

import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAP = Path(os.environ.get("MAP", ROOT / "tests" / "README.md"))
SPEC = Path(os.environ.get("SPEC", ROOT / "docs" / "SPEC.md"))

# Headings whose every item must be named by a row.
MAPPED = [
    "## Promises (each one a test)",
    "## HTTP API",
    "## Command line",
    "## Configuration (environment; flags with the same names in kebab-case)",
    "## Limits and isolation",
    "### High availability and operations",
    "## Delivery endpoints per project",
    "## Registers an auditor can verify",
]
# Headings whose every paragraph of prose must be named by a row too.
MAPPED_PROSE = [
    "## HTTP API",
    "## Command line",
]
# Every test named must say what it asserts (see the module's doc).
STRICT = os.environ.get("SPEC_MAP_STRICT", "1") != "0"
# Headings whose items a row may name too.
NAMEABLE = MAPPED + ["## Gapless sequences", "## Security"]

ROW = re.compile(r"^\|\s*([a-z0-9-]+)\s*\|\s*`([^`]+)`\s*\|\s*(.+?)\s*\|\s*$")
TEST_REF = re.compile(r"`([^`:]+\.rs)::([A-Za-z0-9_]+)`")
ASSERTED_REF = re.compile(r"`([^`:]+\.rs)::([A-Za-z0-9_]+)`\s+asserts\s+`((?:[^`\\]|\\.)+)`")
PENDING = re.compile(r"^pending: .{10,}$")
TEST_ATTRIBUTE = re.compile(r"#\[(tokio::test|test|sqlx::test)\b")


def items_of(spec_lines, heading):
    """The items (a promise, a bullet, a table row) under `heading`, each as
    its lines, and its paragraphs of prose (each as its lines; headings,
    table headers and fenced blocks are neither)."""
    try:
        start = spec_lines.index(heading) + 1
    except ValueError:
        sys.exit(f"spec-map: SPEC has no heading {heading!r}")
    level = heading.split(" ")[0]
    items, paragraphs = [], []
    current = None  # the item or paragraph a continuation line belongs to
    fenced = False
    for line in spec_lines[start:]:
        if line.startswith("```"):
            fenced, current = not fenced, None
            continue
        if fenced:
            continue
        if line.startswith("#"):
            if len(line.split(" ")[0]) <= len(level):
                break
            current = None
        elif re.match(r"^(- |\d+\. |\| `)", line):
            current = [line]
            items.append(current)
        elif not line.strip() or line.startswith("|"):
            current = None  # a blank line ends the item; table headers are no item
        elif current is not None:
            current.append(line)
        else:
            current = [line]
            paragraphs.append(current)
    return items, paragraphs


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


def function_body(lines, start):
    """The lines of the function whose `fn` line is `start`: up to the
    closing brace at the indentation of that line."""
    indent = len(lines[start]) - len(lines[start].lstrip())
    for end in range(start + 1, len(lines)):
        line = lines[end]
        if line.strip() == "}" and len(line) - len(line.lstrip()) == indent:
            return lines[start : end + 1]
    return lines[start:]


def squeeze(text):
    return re.sub(r"\s+", "", text)


def closing(text, open_at):
    """Index just past the bracket matching the one at `open_at`, string
    literals skipped; len(text) when unmatched."""
    depth, i, pairs = 0, open_at, {"(": ")", "[": "]", "{": "}"}
    stack = []
    while i < len(text):
        c = text[i]
        if c == '"':
            i += 1
            while i < len(text) and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
        elif c in pairs:
            stack.append(pairs[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
        i += 1
    return len(text)


_ASSERTING_HELPERS = None


def asserting_helpers():
    """Functions of the test code that assert themselves (their body holds
    an assert macro or a panic), by name: a row may name a call to one."""
    global _ASSERTING_HELPERS
    if _ASSERTING_HELPERS is None:
        names = set()
        for file in list((ROOT / "tests").rglob("*.rs")) + list((ROOT / "src").rglob("*.rs")):
            lines = file.read_text().splitlines()
            for i, line in enumerate(lines):
                found = re.search(r"\bfn ([a-z_][a-z0-9_]*)\s*[(<]", line)
                if found and re.search(r"assert|panic!", "\n".join(function_body(lines, i)[1:])):
                    names.add(found.group(1))
        _ASSERTING_HELPERS = names
    return _ASSERTING_HELPERS


ASSERTION_CALL = re.compile(r"(?:\w*assert\w*!|panic!|unreachable!|\b(?:eventually\w*|until)|(?:\.|\b)([a-z_][a-z0-9_]*))\(")


def asserted_in(path, name, code):
    """Whether `code` stands inside an assertion of test `name` in `path`."""
    lines = (ROOT / path).read_text().splitlines()
    for i, line in enumerate(lines):
        if re.search(rf"\bfn {re.escape(name)}\s*[(<]", line):
            body = squeeze("\n".join(function_body(lines, i)[1:]))
            break
    else:
        return False
    wanted = squeeze(code.replace("\\|", "|"))
    helpers = asserting_helpers()
    start = body.find(wanted)
    while start >= 0:
        for call in ASSERTION_CALL.finditer(body):
            if call.start() > start:
                break
            if call.group(1) and call.group(1) not in helpers:
                continue
            if closing(body, call.end() - 1) >= start + len(wanted):
                return True
        start = body.find(wanted, start + 1)
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
        asserted = {(path, test): code for path, test, code in ASSERTED_REF.findall(tests)}
        for path, test, code in ASSERTED_REF.findall(tests):
            if is_test(path, test) and not asserted_in(path, test, code):
                errors.append(f"{where}: {path}::{test} does not assert `{code}`")
        for path, test in refs:
            if not is_test(path, test):
                errors.append(f"{where}: {path}::{test} is not a test")
            elif STRICT and (path, test) not in asserted:
                errors.append(f"{where}: {path}::{test}: what it asserts is not named")
    required = [(h, nameable[h]) for h in MAPPED]
    required += [(f"{h} (text)", nameable[f"{h} (text)"]) for h in MAPPED_PROSE]
    for heading, items in required:
        for i, item in enumerate(items):
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
