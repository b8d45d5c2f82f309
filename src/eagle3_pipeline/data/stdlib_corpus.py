"""The text corpus that ships with every machine: docstrings of Python's standard library.

Both the embedded tiny model (its tokenizer and training text) and the demo conversations are
made from it, so nothing is downloaded. Source files are parsed with ``ast``, never imported:
importing stdlib modules can have side effects (``antigravity`` opens a browser, ``this``
prints). Files are visited in sorted module-name order, so the corpus is the same on every run
of the same Python.
"""

from __future__ import annotations

import ast
import copy
import hashlib
import sysconfig
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

# Bump when the extraction below changes what it yields; it is part of every corpus fingerprint.
EXTRACTOR_VERSION = 1

# Folders of the stdlib that hold no library docs worth learning from (tests, demos, tooling).
SKIPPED_PACKAGES = frozenset(
    {"test", "tests", "idle_test", "idlelib", "turtledemo", "lib2to3", "ensurepip", "pydoc_data", "venv"}
)


@dataclass(frozen=True)
class DocEntry:
    """One documented object of the standard library.

    ``qualname`` is empty for a module's own docstring; ``signature`` is the parameter list as
    written in the source (without ``self``/``cls``), empty where there is none.
    """

    module: str
    qualname: str
    kind: str  # "module" | "class" | "function" | "method"
    signature: str
    docstring: str

    @property
    def name(self) -> str:
        """The dotted name a user would type, e.g. ``json.dumps`` or ``json.encoder.JSONEncoder.encode``."""
        return f"{self.module}.{self.qualname}" if self.qualname else self.module

    @property
    def paragraphs(self) -> list[str]:
        """The docstring's paragraphs, each with its lines joined by single spaces."""
        return [" ".join(line.strip() for line in block.splitlines()) for block in _blocks(self.docstring)]

    @property
    def summary(self) -> str:
        """The first paragraph of the docstring."""
        paragraphs = self.paragraphs
        return paragraphs[0] if paragraphs else ""


def _blocks(text: str) -> list[str]:
    blocks, current = [], []
    for line in text.splitlines():
        if line.strip():
            current.append(line)
        elif current:
            blocks.append("\n".join(current))
            current = []
    if current:
        blocks.append("\n".join(current))
    return blocks


def stdlib_root() -> Path:
    """The directory of this interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_source_files(root: Path | None = None) -> list[tuple[str, Path]]:
    """``(module name, source file)`` of every public stdlib module, sorted by module name.

    Skipped: private modules (a name part starting with ``_``), ``__main__`` files, folders that
    are not packages (``site-packages``, ``config-3.x-...``) and the ``SKIPPED_PACKAGES``.
    """
    root = root or stdlib_root()
    modules = []
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        if not parts or parts[-1] == "__main__":
            continue
        if any(not part.isidentifier() or part.startswith("_") or part in SKIPPED_PACKAGES for part in parts):
            continue
        modules.append((".".join(parts), path))
    return sorted(modules)


def corpus_fingerprint(files: Iterable[tuple[str, Path]] | None = None) -> str:
    """SHA-256 of the extractor's version and every selected source file's name and bytes.

    Cheap (no parsing), so a cached build can be checked against the corpus in well under a second.
    """
    digest = hashlib.sha256(f"stdlib-corpus-v{EXTRACTOR_VERSION}\n".encode())
    for module, path in stdlib_source_files() if files is None else files:
        data = path.read_bytes()
        digest.update(f"{module}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef, is_method: bool) -> str:
    args = copy.copy(node.args)
    if is_method and args.posonlyargs:
        args.posonlyargs = args.posonlyargs[1:]
    elif is_method and args.args:
        args.args = args.args[1:]
    return f"({ast.unparse(args)})"


def _is_public(name: str) -> bool:
    return not name.startswith("_")


def _module_entries(module: str, tree: ast.Module) -> list[DocEntry]:
    entries = []
    doc = ast.get_docstring(tree)
    if doc:
        entries.append(DocEntry(module, "", "module", "", doc))
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_public(node.name):
            doc = ast.get_docstring(node)
            if doc:
                entries.append(DocEntry(module, node.name, "function", _signature(node, False), doc))
        elif isinstance(node, ast.ClassDef) and _is_public(node.name):
            init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
            doc = ast.get_docstring(node)
            if doc:
                signature = _signature(init, True) if init else ""
                entries.append(DocEntry(module, node.name, "class", signature, doc))
            for member in node.body:
                if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_public(member.name):
                    doc = ast.get_docstring(member)
                    if doc:
                        qualname = f"{node.name}.{member.name}"
                        entries.append(DocEntry(module, qualname, "method", _signature(member, True), doc))
    return entries


def extract_entries(files: Iterable[tuple[str, Path]] | None = None) -> list[DocEntry]:
    """Every documented public module, class, function and method, in file order, names unique.

    A name defined twice in one file (platform-dependent definitions) keeps its first docstring.
    Files that do not parse on this Python are skipped.
    """
    entries, seen = [], set()
    for module, path in stdlib_source_files() if files is None else files:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # invalid escape sequences in old sources
                tree = ast.parse(path.read_bytes(), filename=str(path))
        except (SyntaxError, ValueError):
            continue
        for entry in _module_entries(module, tree):
            if entry.name not in seen:
                seen.add(entry.name)
                entries.append(entry)
    return entries
