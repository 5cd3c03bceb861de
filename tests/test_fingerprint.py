"""The data's part of a run's fingerprint (refimpl/tools/saved_runs/fingerprint.py) is the SHA-256
of the whole file: every byte counts, wherever it is and in whatever order.

A shortcut that hashed the first chunk (1 MiB) only, or the file's size, or its bytes as a multiset
(a histogram, sorted bytes), would call two different data sets the same run; the files here are
equal in all of those and differ in one byte, or in the order of two.
"""

from __future__ import annotations

import hashlib

import pytest

from refimpl.tools.run import TrainConfig
from refimpl.tools.saved_runs import fingerprint

MIB = 1 << 20


def body(size: int) -> bytes:
    """`size` bytes of text."""
    line = b"the quick brown fox jumps over the lazy dog 0123456789\n"
    return (line * (size // len(line) + 1))[:size]


def write(path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def test_files_equal_in_their_first_mib_and_their_characters_are_different_data(tmp_path):
    """sha256(file) of the whole contents: two files of the same size, the same first MiB and the
    same multiset of bytes (the last two swapped) have different fingerprints."""
    prefix = body(MIB)
    a = write(tmp_path / "a.txt", prefix + b"xy")
    b = write(tmp_path / "b.txt", prefix + b"yx")
    assert sorted(open(a, "rb").read()) == sorted(open(b, "rb").read())
    assert fingerprint.file_sha256(a) == hashlib.sha256(prefix + b"xy").hexdigest()
    assert fingerprint.file_sha256(b) == hashlib.sha256(prefix + b"yx").hexdigest()
    ours, theirs = fingerprint.of(TrainConfig(data=a)), fingerprint.of(TrainConfig(data=b))
    assert ours["sha256"] != theirs["sha256"]
    assert [d.split(":")[0] for d in fingerprint.differences(theirs, ours)] == ["--data"]


@pytest.mark.parametrize("where", [0, 1, MIB - 1, MIB, MIB + 1, 2 * MIB + 5, -1])
def test_one_byte_changed_anywhere_changes_the_fingerprint(tmp_path, where):
    """sha256 of every byte, read in 1 MiB chunks: a byte changed at the start, at either side of a
    chunk's end, or last (2 MiB + 7 bytes: three chunks) gives another digest, SHA-256's own."""
    data = body(2 * MIB + 7)
    changed = bytearray(data)
    changed[where] ^= 0x01
    a = write(tmp_path / "original.txt", data)
    b = write(tmp_path / "changed.txt", bytes(changed))  # another path: never the cached digest of `a`
    assert fingerprint.file_sha256(a) == hashlib.sha256(data).hexdigest()
    assert fingerprint.file_sha256(b) == hashlib.sha256(bytes(changed)).hexdigest()
    assert fingerprint.file_sha256(a) != fingerprint.file_sha256(b)


def test_the_same_bytes_at_another_path_are_the_same_data(tmp_path):
    """The path is recorded for messages only: a copy of the file is the same run."""
    data = body(MIB + 3)
    (tmp_path / "node").mkdir()
    a = write(tmp_path / "a.txt", data)
    b = write(tmp_path / "node" / "a.txt", data)
    ours, theirs = fingerprint.of(TrainConfig(data=a)), fingerprint.of(TrainConfig(data=b))
    assert ours["sha256"] == theirs["sha256"] and ours["data_path"] != theirs["data_path"]
    assert fingerprint.differences(theirs, ours) == []
