"""README's "Where things live" against the tree: every module of engine/, tasks/ and flows/
is on the map, and every file the map names exists.

The map is an indented tree (two spaces a level) of `name   what it is for` lines: `dir/`
opens a directory; `a.py, b.py` lists siblings; `families/llama.py, mistral.py` puts the
names after the first in the first one's directory; a line of names ending in `,` goes on
over the next line. A directory with nothing listed under it (`cpu_kernels/`) stands for
everything in it. Package `__init__.py` files need no line. Reads files only; no imports.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "tasks", "flows")
NAMES = re.compile(r"^[\w.]+/?(?:[\w./]*)(?:, [\w./]+)*,?$")


def readme_map(readme: str) -> str:
    section = readme.split("## Where things live", 1)[1]
    match = re.search(r"^```[^\n]*\n(.*?)^```", section, re.S | re.M)
    assert match, "README.md: no code block under '## Where things live'"
    return match.group(1)


def mapped_paths(tree_text: str) -> tuple[set[str], set[str]]:
    """(files named, directories named with nothing listed under them), relative to the root."""
    files: set[str] = set()
    dirs: dict[str, bool] = {}  # directory -> has listed children
    stack: list[tuple[int, str]] = []  # (indent, directory)
    pending, pending_indent = "", 0  # names of a line ending in "," waiting for the rest, and its indent
    for line in tree_text.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        names = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
        if pending:
            names, indent = pending + " " + names, pending_indent
            pending = ""
        if not NAMES.match(names):
            continue  # a description going on from the line above
        if names.endswith(","):
            pending, pending_indent = names, indent
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        parent = stack[-1][1] if stack else ""
        if parent:
            dirs[parent] = True
        first, *rest = names.split(", ")
        prefix = first.rsplit("/", 1)[0] + "/" if "/" in first.rstrip("/") else ""
        for name in [first, *(prefix + other for other in rest)]:
            path = parent + name
            if name.endswith("/"):
                dirs.setdefault(path, False)
                stack.append((indent, path))
            else:
                files.add(path)
    return files, {d for d, has_children in dirs.items() if not has_children}


def modules() -> set[str]:
    return {
        path.relative_to(ROOT).as_posix()
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if path.name != "__init__.py" and "__pycache__" not in path.parts and "build" not in path.parts
    }


def unmapped(readme: str) -> tuple[list[str], list[str]]:
    """(modules missing from the map, map entries naming no file)."""
    files, leaf_dirs = mapped_paths(readme_map(readme))
    missing = sorted(m for m in modules() if m not in files and not any(m.startswith(d) for d in leaf_dirs))
    stale = sorted(f for f in files if not (ROOT / f).exists())
    return missing, stale


def test_the_readme_map_lists_every_module():
    missing, stale = unmapped((ROOT / "README.md").read_text())
    assert not missing, "README.md 'Where things live' misses these modules (add a line for each):\n" + "\n".join(
        missing
    )
    assert not stale, "README.md 'Where things live' names files that do not exist:\n" + "\n".join(stale)


def test_the_map_check_names_a_missing_module():
    readme = (ROOT / "README.md").read_text()
    assert "  gang.py" in readme
    missing, stale = unmapped(readme.replace("  gang.py", "  gangs.py"))
    assert "tasks/launch/gang.py" in missing and "tasks/launch/gangs.py" in stale
