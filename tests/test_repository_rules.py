"""Rules of the repository's shape that a refactor could silently break: the cache package stays
torch-free, and every file, test and class member the docs cite exists."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
SOURCE_DIRS = ("radixinfer", "kernels", "tests", "property_tests", "benchmarks")


def test_cache_package_imports_without_torch():
    """Every module of `radixinfer/cache/` imports with torch blocked. The package's parent
    (`radixinfer/__init__.py`, which builds the whole API) is stood in for by an empty package, so
    only the cache modules and what they import are loaded."""
    modules = sorted(p.stem for p in (ROOT / "radixinfer" / "cache").glob("*.py"))
    script = f"""
import importlib, sys, types
sys.modules["torch"] = None  # any `import torch` now raises ImportError
parent = types.ModuleType("radixinfer")
parent.__path__ = [{str(ROOT / "radixinfer")!r}]
sys.modules["radixinfer"] = parent
for name in {modules!r}:
    importlib.import_module("radixinfer.cache." + name if name != "__init__" else "radixinfer.cache")
loaded = sorted(m for m in sys.modules if m.startswith("radixinfer."))
assert all(m.startswith("radixinfer.cache") for m in loaded), loaded
"""
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "kv_manager" in modules and "radix_tree" in modules  # the check saw the package


@cache
def _repo_files() -> list[Path]:
    return [p for d in SOURCE_DIRS for p in (ROOT / d).rglob("*") if p.is_file()] + [
        p for p in ROOT.glob("docs/*") if p.is_file()
    ]


def _resolve(cited: str) -> Path | None:
    """A cited path: from the repository root, from `radixinfer/`, or a file name found once."""
    for base in (ROOT, ROOT / "radixinfer"):
        if (base / cited).exists():
            return base / cited
    if "/" not in cited.rstrip("/"):
        found = [p for p in _repo_files() if p.name == cited]
        if len(found) == 1:
            return found[0]
    return None


@cache
def _definitions(path: Path) -> tuple[frozenset[str], dict[str, frozenset[str]]]:
    """Names a Python file defines at top level, and per class its methods and attributes
    (class-level assignments and ``self.x = ...`` in its methods)."""
    tree = ast.parse(path.read_text())
    top: set[str] = set()
    classes: dict[str, frozenset[str]] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            top.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            top.update(t.id for t in targets if isinstance(t, ast.Name))
        if isinstance(node, ast.ClassDef):
            members = set()
            for item in ast.walk(node):
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    members.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    members.add(item.target.id)
                elif isinstance(item, ast.Assign):
                    members.update(t.id for t in item.targets if isinstance(t, ast.Name))
                elif isinstance(item, ast.Attribute) and isinstance(item.ctx, ast.Store):
                    members.add(item.attr)
            classes[node.name] = frozenset(members)
    return frozenset(top), classes


@cache
def _classes() -> dict[str, list[frozenset[str]]]:
    """Every class of the Python sources, by name: the members of each class of that name."""
    found: dict[str, list[frozenset[str]]] = {}
    for path in _repo_files():
        if path.suffix == ".py":
            for name, members in _definitions(path)[1].items():
                found.setdefault(name, []).append(members)
    return found


def _cited(doc: Path) -> list[tuple[str, str]]:
    """The backticked spans of a doc outside its code blocks, each with the span right after it
    when only blanks separate them (`path.py` `Name.member`), else ""."""
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
    spans = list(re.finditer(r"`([^`\n]+)`", text))
    return [
        (span[1], after[1] if after and not text[span.end() : after.start()].strip() else "")
        for span, after in zip(spans, spans[1:] + [None])
    ]


PATH = re.compile(
    r"^[\w./-]+\.(py|md|sh|toml)(::\w+)?$|^(radixinfer|kernels|tests|benchmarks)/[\w/]*$"
)
MEMBER = re.compile(r"^([A-Z]\w*)\.(\w+)$")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_docs_cite_files_tests_and_members_that_exist(doc):
    """Each backticked path exists (`path::name`: the file defines ``name``); each `path.py` followed
    by a backticked `Name` or `Name.member` defines it; each backticked `Class.member` of a class
    in the sources names a member of that class."""
    missing = []
    for span, following in _cited(doc):
        if PATH.match(span):
            cited, _, name = span.partition("::")
            path = _resolve(cited)
            if path is None:
                missing.append(span)
                continue
            if not name and path.suffix == ".py" and re.fullmatch(r"\w+(\.\w+)?", following):
                name = following
            if name and path.suffix == ".py":
                top, classes = _definitions(path)
                owner, _, member = name.partition(".")
                if owner not in top or (member and member not in classes.get(owner, ())):
                    missing.append(f"{span} {name}")
        elif match := MEMBER.match(span):
            owner, member = match.groups()
            if owner in _classes() and not any(member in m for m in _classes()[owner]):
                missing.append(span)
    assert not missing, f"{doc.name} cites what does not exist: {missing}"
