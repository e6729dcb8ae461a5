"""Tests of rrfp.data: text samples, microbatches, padding and batch sampling."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rrfp.data import (
    IGNORE_INDEX,
    PAD_ID,
    BatchSampler,
    default_corpus_paths,
    load_samples,
    make_microbatches,
    microbatch_sizes,
    pad_batch,
    split_paragraphs,
    split_top_level_blocks,
)
from rrfp.model import IGNORE_INDEX as MODEL_IGNORE_INDEX

STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="module")
def stdlib_samples() -> list[bytes]:
    return load_samples(None, 64, seed=0, limit=1500)


# --- corpus -------------------------------------------------------------------


def test_default_corpus_is_stdlib_python():
    paths = default_corpus_paths()
    assert len(paths) > 100
    assert paths == sorted(paths)
    for p in paths:
        assert p.suffix == ".py" and STDLIB in p.parents
        assert "site-packages" not in p.parts and "test" not in p.parts


def test_stdlib_samples(stdlib_samples):
    assert len(stdlib_samples) == 1500
    lengths = [len(s) for s in stdlib_samples]
    assert all(isinstance(s, bytes) for s in stdlib_samples)
    assert min(lengths) >= 2 and max(lengths) == 65  # max_len + 1
    assert len(set(lengths)) > 40, "samples should keep their natural, varied lengths"
    assert sum(n < 65 for n in lengths) > len(lengths) // 4
    # Samples are whole top-level units, e.g. function definitions.
    assert any(s.startswith(b"def ") for s in stdlib_samples)
    assert any(s.startswith(b"class ") for s in stdlib_samples)


def test_samples_are_deterministic_per_seed(stdlib_samples):
    assert load_samples(None, 64, seed=0, limit=1500) == stdlib_samples
    other = load_samples(None, 64, seed=1, limit=1500)
    assert other != stdlib_samples


def test_limit_stops_early():
    few = load_samples(None, 32, seed=3, limit=10)
    assert len(few) == 10


def _write(root: Path, rel: str, data: bytes) -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_folder_is_walked_recursively(tmp_path):
    _write(tmp_path, "a.py", b"import os\n\n\ndef f(x):\n    return x\n\nclass A:\n    pass\n")
    _write(tmp_path, "sub/deeper/notes.md", b"First paragraph\nstill first.\n\n\nSecond one.\n")
    _write(tmp_path, "sub/data.bin", b"not read: suffix\n")
    _write(tmp_path, "sub/binary.txt", b"has a NUL \x00 byte\n")
    _write(tmp_path, "__pycache__/x.py", b"skipped = 1\n")
    samples = load_samples([tmp_path], max_len=100, seed=0)
    assert sorted(samples) == sorted([
        b"import os\n",
        b"def f(x):\n    return x\n",
        b"class A:\n    pass\n",
        b"First paragraph\nstill first.\n",
        b"Second one.\n",
    ])


def test_file_paths_and_cutting(tmp_path):
    long_paragraph = b"x" * 500
    path = _write(tmp_path, "doc.rst", long_paragraph + b"\n\nok\n\nz\n")
    samples = load_samples([str(path)], max_len=16, seed=0)
    assert sorted(samples) == sorted([b"x" * 17, b"ok\n", b"z\n"])
    blank = _write(tmp_path, "blank.txt", b"\n  \n\n")
    with pytest.raises(ValueError, match="blank.txt' yield no usable text"):
        load_samples([blank], max_len=16, seed=0)


def test_missing_and_empty_paths(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError) as err:
        load_samples([missing], 16, 0)
    assert str(err.value) == f"data path '{missing}' does not exist"
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="empty' contains no text files"):
        load_samples([empty], 16, 0)
    binary = _write(tmp_path, "bin/blob.txt", b"\x00\x01\x02")
    with pytest.raises(ValueError, match="blob.txt' yield no usable text"):
        load_samples([binary], 16, 0)
    with pytest.raises(ValueError, match="max_len=0"):
        load_samples([binary], 0, 0)


def test_split_top_level_blocks():
    source = b'''"""Module docstring.

Column-0 text inside the docstring.
"""
import os
x = call(
    1,
)

# A comment paragraph
@decorator
def f():
    return 1
# trailing comment stays with f

class A:
    """Doc."""

    def m(self):
        pass
'''
    assert split_top_level_blocks(source) == [
        b'"""Module docstring.\n\nColumn-0 text inside the docstring.\n"""\n',
        b"import os\n",
        b"x = call(\n    1,\n)\n",
        b"# A comment paragraph\n@decorator\ndef f():\n    return 1\n# trailing comment stays with f\n",
        b'class A:\n    """Doc."""\n\n    def m(self):\n        pass\n',
    ]
    assert split_top_level_blocks(b"\n\n") == []


def test_split_paragraphs():
    assert split_paragraphs(b"\na\nb\n\n \n\nc") == [b"a\nb\n", b"c\n"]


# --- microbatches and padding -------------------------------------------------


def test_ignore_index_is_shared():
    assert IGNORE_INDEX == MODEL_IGNORE_INDEX == -100 and PAD_ID == 0


def test_pad_batch():
    tokens, targets = pad_batch([b"abc", b"hello"])
    assert tokens.shape == targets.shape == (2, 4)
    assert tokens.dtype == targets.dtype == torch.int64
    assert tokens.tolist() == [[97, 98, PAD_ID, PAD_ID], list(b"hell")]
    assert targets.tolist() == [[98, 99, IGNORE_INDEX, IGNORE_INDEX], list(b"ello")]


def test_microbatches_pad_to_their_own_length():
    samples = [b"ab", b"abcdef", b"xyz", b"0123456789", b"hi"]
    mbs = make_microbatches(samples, 3)
    assert [mb.size for mb in mbs] == [2, 2, 1]
    assert [tuple(mb.tokens.shape) for mb in mbs] == [(2, 5), (2, 9), (1, 1)]
    assert mbs[0].tokens.tolist() == [[97, PAD_ID, PAD_ID, PAD_ID, PAD_ID], list(b"abcde")]
    assert mbs[0].targets.tolist() == [[98] + [IGNORE_INDEX] * 4, list(b"bcdef")]
    assert mbs[2].tokens.tolist() == [[104]] and mbs[2].targets.tolist() == [[105]]
    assert [mb.n_tokens for mb in mbs] == [1 + 5, 2 + 9, 1]
    _, full_targets = pad_batch(samples)
    assert sum(mb.n_tokens for mb in mbs) == int((full_targets != IGNORE_INDEX).sum())


@settings(max_examples=60, deadline=None)
@given(batch=st.integers(1, 24), data=st.data())
def test_microbatches_follow_tensor_split(batch, data):
    n = data.draw(st.integers(1, batch))
    lengths = data.draw(st.lists(st.integers(2, 12), min_size=batch, max_size=batch))
    samples = [bytes([65 + i % 26]) * length for i, length in enumerate(lengths)]
    mbs = make_microbatches(samples, n)
    expected = torch.tensor_split(torch.arange(batch), n)
    assert microbatch_sizes(batch, n) == [len(t) for t in expected]
    assert [mb.size for mb in mbs] == [len(t) for t in expected]
    for mb, idx in zip(mbs, expected):
        own = [samples[i] for i in idx.tolist()]
        assert mb.tokens.shape[1] == max(len(s) for s in own) - 1
        assert mb.tokens[:, 0].tolist() == [s[0] for s in own]  # contiguous, in order


def test_microbatch_errors():
    with pytest.raises(ValueError) as err:
        make_microbatches([b"ab"] * 4, 8)
    assert str(err.value) == (
        "n_microbatches=8 exceeds the batch size 4: each microbatch needs at least one sample"
    )
    with pytest.raises(ValueError, match="n_microbatches=0"):
        make_microbatches([b"ab"], 0)
    with pytest.raises(ValueError, match="empty"):
        make_microbatches([], 1)
    with pytest.raises(ValueError, match="sample 1 has 1 byte"):
        pad_batch([b"ab", b"a"])


# --- batch sampling -----------------------------------------------------------


def test_batch_sampler_epochs_and_determinism():
    samples = [bytes([65 + i]) * 2 for i in range(10)]
    sampler = BatchSampler(samples, batch_size=3, seed=5)
    assert sampler.batches_per_epoch == 3
    it = iter(sampler)
    batches = [next(it) for _ in range(9)]
    assert all(len(b) == 3 for b in batches)
    for epoch in range(3):
        seen = [s for b in batches[3 * epoch : 3 * epoch + 3] for s in b]
        assert len(set(seen)) == 9  # no repeats within an epoch
    assert batches[:3] != batches[3:6]  # reshuffled per epoch
    # Deterministic, restartable and randomly accessible.
    again = BatchSampler(samples, batch_size=3, seed=5)
    assert [again.batch(step) for step in reversed(range(9))] == batches[::-1]
    assert [b for b, _ in zip(sampler, range(9))] == batches
    assert [b for b, _ in zip(BatchSampler(samples, 3, seed=6), range(9))] != batches


def test_batch_sampler_errors():
    with pytest.raises(ValueError, match="batch_size=5 exceeds the number of samples 4"):
        BatchSampler([b"ab"] * 4, 5, 0)
    with pytest.raises(ValueError, match="batch_size=0"):
        BatchSampler([b"ab"] * 4, 0, 0)
    with pytest.raises(ValueError, match="step=-1"):
        BatchSampler([b"ab"] * 4, 2, 0).batch(-1)


def test_a_large_file_is_streamed_not_read_whole(tmp_path):
    import tracemalloc

    from rrfp.data.text import load_samples

    big = tmp_path / "big.txt"
    para = b"word " * 40 + b"\n\n"
    with open(big, "wb") as f:
        for _ in range(32):
            f.write(para * 4096)  # 32 x 0.8 MiB = 26 MiB of 202-byte paragraphs
    tracemalloc.start()
    try:
        samples = load_samples([big], 64, seed=0, limit=100)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(samples) == 100 and all(s == para[:65] for s in samples)
    assert peak < 2 * 1024**2, f"peak {peak} bytes while loading 100 samples from a 26 MiB file"
