"""Real text samples of natural, varied length for byte-level language modelling.

A sample is one self-contained unit of a text file: one top-level block of
Python source (a ``def``/``class``/statement with its indented body, plus any
decorators and leading comment lines) or one paragraph of prose. Lengths
therefore vary the way real data does, which is what makes per-microbatch
padding and readiness-driven scheduling interesting.

Tokenization is the identity on bytes: token ids are byte values ``0..255``;
padding uses :data:`PAD_ID` in inputs and ``IGNORE_INDEX`` in targets.
"""

from __future__ import annotations

import os
import random
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from rrfp.model.gpt import IGNORE_INDEX

__all__ = [
    "PAD_ID",
    "IGNORE_INDEX",
    "TEXT_SUFFIXES",
    "CODE_SUFFIXES",
    "default_corpus_paths",
    "load_samples",
    "split_top_level_blocks",
    "split_paragraphs",
]

PAD_ID = 0
"""Token id used to pad inputs (byte 0 never occurs in text files we read)."""

CODE_SUFFIXES = frozenset({".py", ".pyi", ".pyw"})
"""Files split into top-level blocks rather than paragraphs."""

TEXT_SUFFIXES = CODE_SUFFIXES | frozenset(
    {".txt", ".md", ".rst", ".text", ".tex", ".cfg", ".ini", ".toml", ".yaml", ".yml",
     ".c", ".h", ".cpp", ".hpp", ".rs", ".go", ".js", ".ts", ".sh", ".html", ".css"}
)
"""Suffixes picked up when walking a folder; files named directly are read whatever their suffix."""

_TEST_DIRS = frozenset({"test", "tests", "idle_test"})
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def default_corpus_paths() -> list[Path]:
    """The Python standard library's ``*.py`` source files, sorted.

    Taken from ``sysconfig.get_paths()["stdlib"]`` of the running interpreter,
    without ``site-packages``/``dist-packages`` and without the test suites
    (folders named ``test``, ``tests``, ``idle_test``), whose fixtures include
    deliberately malformed files.

    Returns:
        Absolute file paths in sorted order (hundreds of files).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [
            d for d in dirnames
            if d not in _SKIP_DIRS and d not in _TEST_DIRS and not d.startswith(".")
        ]
        found.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted(found)


def _walk_text_files(folder: Path) -> list[Path]:
    found = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(
            d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(".")
        )
        found.extend(
            Path(dirpath, f)
            for f in sorted(filenames)
            if not f.startswith(".") and Path(f).suffix.lower() in TEXT_SUFFIXES
            # Only regular files: reading a FIFO or device named *.txt would block forever.
            and Path(dirpath, f).is_file()
        )
    return found


def _is_blank(line: bytes) -> bool:
    return not line.strip()


def _finish(lines: list[bytes]) -> bytes:
    # Trailing blank lines belong to the gap between blocks, not to the block.
    return b"".join(lines).rstrip() + b"\n"


def _scan_triple_quotes(line: bytes, open_delim: bytes | None) -> bytes | None:
    """Return the triple-quote delimiter still open after ``line`` (approximate: ignores escapes)."""
    i = 0
    while True:
        if open_delim is not None:
            j = line.find(open_delim, i)
            if j < 0:
                return open_delim
            i, open_delim = j + 3, None
        else:
            hits = [(j, d) for d in (b'"""', b"'''") if (j := line.find(d, i)) >= 0]
            if not hits:
                return None
            comment = line.find(b"#", i)
            j, delim = min(hits)
            if 0 <= comment < j:
                return None
            i, open_delim = j + 3, delim


def split_top_level_blocks(source: bytes) -> list[bytes]:
    """Split Python source into top-level blocks.

    A block starts at a non-blank line without indentation and runs until the
    next such line, so it includes the indented body. Heuristics keep units
    whole: decorators and a comment paragraph stay with the statement that
    follows them, a line opening with a closing bracket (``)``, ``]``, ``}``)
    continues the statement it closes, and lines inside a triple-quoted
    string never start a block. Each block ends with exactly one newline.

    Args:
        source: file contents.

    Returns:
        Blocks in file order; empty for a blank file.
    """
    return list(_iter_blocks(source.splitlines(keepends=True)))


def _iter_blocks(lines: Iterable[bytes], keep: int | None = None) -> Iterator[bytes]:
    """:func:`split_top_level_blocks` over lines, with bounded memory: with ``keep``, a block
    holds only its first lines (at least ``keep`` bytes; its boundaries are still found), and
    a cut block is yielded unstripped, so its first ``keep`` bytes equal the whole block's."""
    current: list[bytes] = []
    size, more = 0, False
    header_only = False  # current holds only decorators/comments so far
    prev_blank = True
    open_delim: bytes | None = None
    for line in lines:
        blank = _is_blank(line)
        if not current and blank:
            continue
        top_level = open_delim is None and not blank and line[:1] not in b" \t\x0c"
        if top_level and not line[:1] in b")]}":
            is_header = line[:1] == b"@" or (line[:1] == b"#" and (prev_blank or header_only))
            if header_only:
                header_only = is_header
            elif line[:1] != b"#" or prev_blank:
                if current:
                    yield b"".join(current) if more else _finish(current)
                current, size, more = [], 0, False
                header_only = is_header
        elif not blank and open_delim is None:
            header_only = False
        if keep is None or size < keep:
            current.append(line)
            size += len(line)
        elif not blank:
            more = True
        prev_blank = blank
        if not blank:
            open_delim = _scan_triple_quotes(line, open_delim)
    if current:
        yield b"".join(current) if more else _finish(current)


def split_paragraphs(text: bytes) -> list[bytes]:
    """Split prose into paragraphs separated by one or more blank lines.

    Args:
        text: file contents.

    Returns:
        Paragraphs in file order, each ending with exactly one newline.
    """
    return list(_iter_paragraphs(text.splitlines(keepends=True)))


def _iter_paragraphs(lines: Iterable[bytes], keep: int | None = None) -> Iterator[bytes]:
    """:func:`split_paragraphs` over lines, bounded by ``keep`` as :func:`_iter_blocks` is."""
    current: list[bytes] = []
    size, more = 0, False
    for line in lines:
        if _is_blank(line):
            if current:
                yield b"".join(current) if more else _finish(current)
                current, size, more = [], 0, False
        elif keep is None or size < keep:
            current.append(line)
            size += len(line)
        else:
            more = True
    if current:
        yield b"".join(current) if more else _finish(current)


class _BinaryFile(Exception):
    pass


_LINE_CAP = 1 << 20
"""Longest line kept whole when streaming a file; the rest of a longer line is skipped."""


def _file_lines(f: BinaryIO) -> Iterator[bytes]:
    """Lines of an open file, read in bounded pieces; raises _BinaryFile at the first NUL."""
    while line := f.readline(_LINE_CAP):
        if b"\x00" in line:
            raise _BinaryFile
        if len(line) == _LINE_CAP and not line.endswith(b"\n"):
            while (rest := f.readline(_LINE_CAP)) and not rest.endswith(b"\n"):
                if b"\x00" in rest:
                    raise _BinaryFile
            if b"\x00" in rest:
                raise _BinaryFile
            line += b"\n"
        yield line


def _expand(paths: list[str | Path]) -> list[Path]:
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise FileNotFoundError(f"data path '{raw}' does not exist")
        if path.is_dir():
            found = _walk_text_files(path)
            if not found:
                raise ValueError(
                    f"data path '{raw}' contains no text files "
                    f"(looked for {', '.join(sorted(TEXT_SUFFIXES))})"
                )
            files.extend(found)
        else:
            files.append(path)
    # The same file reached through two paths would double its weight.
    unique, seen = [], set()
    for f in files:
        key = f.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(f)
    return unique


def load_samples(
    paths: list[str | Path] | None,
    max_len: int,
    seed: int,
    limit: int | None = None,
) -> list[bytes]:
    """Load text samples of natural length from files and folders.

    Files are read in an order shuffled by ``seed``; each is split into
    top-level blocks (``.py``/``.pyi``/``.pyw``) or paragraphs (everything
    else), every unit is cut to ``max_len + 1`` bytes (``max_len`` input and
    target positions) and units shorter than 2 bytes are dropped. Files are
    streamed in lines of at most 1 MiB (the rest of a longer line is
    skipped), never read whole; reading stops after the file that brings
    ``limit`` samples, and within it at ``2 * limit``, so a limit keeps
    loading fast and memory near ``2 * limit * max_len`` bytes on any corpus. The samples are then shuffled by ``seed``. The result
    depends only on the file contents, ``max_len``, ``seed`` and ``limit``.

    Args:
        paths: files and/or folders; folders are walked recursively for
            files with a suffix in :data:`TEXT_SUFFIXES` (hidden entries and
            ``__pycache__`` skipped). Files with a NUL byte in the part
            read are treated as binary and skipped. ``None`` means :func:`default_corpus_paths`.
        max_len: most input positions per sample (samples have at most
            ``max_len + 1`` bytes); normally the model's ``max_len``.
        seed: shuffling seed.
        limit: most samples to return; ``None`` reads every file.

    Returns:
        Between 1 and ``limit`` samples, each ``bytes`` of length
        ``2..max_len + 1``.

    Raises:
        FileNotFoundError: ``data path 'x' does not exist`` for a missing path.
        ValueError: if ``max_len < 1`` or ``limit < 1``, a folder holds no text
            files, or the paths yield no usable sample (message names them).
    """
    if max_len < 1:
        raise ValueError(f"max_len={max_len} must be >= 1")
    if limit is not None and limit < 1:
        raise ValueError(f"limit={limit} must be >= 1 or None")
    files = default_corpus_paths() if paths is None else _expand(list(paths))
    rng = random.Random(seed)
    rng.shuffle(files)
    samples: list[bytes] = []
    # Streamed: a file is read in bounded lines, never whole, and reading stops after the
    # file that brings ``limit`` samples (at 2 x limit at most): memory is about
    # 2 x limit x max_len whatever the file sizes.
    split = {True: _iter_blocks, False: _iter_paragraphs}
    for f in files:
        found: list[bytes] = []
        try:
            with open(f, "rb") as fh:
                for unit in split[f.suffix.lower() in CODE_SUFFIXES](_file_lines(fh), keep=max_len + 1):
                    if len(cut := unit[: max_len + 1]) >= 2:
                        found.append(cut)
                        # The file that crosses the limit is read on (its samples join the
                        # shuffle, as they always did) up to twice the limit, no further.
                        if limit is not None and len(samples) + len(found) >= 2 * limit:
                            break
        except _BinaryFile:
            continue
        samples.extend(found)
        if limit is not None and len(samples) >= limit:
            break
    if not samples:
        names = "the default corpus" if paths is None else ", ".join(f"'{p}'" for p in paths)
        raise ValueError(
            f"data path(s) {names} yield no usable text samples "
            "(need non-binary text with units of at least 2 bytes)"
        )
    rng.shuffle(samples)
    return samples[:limit] if limit is not None else samples
