"""--data text files (data.TextTask): strict UTF-8 with the offset of a bad byte, non-regular files
named as such, and the vectorised loading equal to the per-character loop it replaced."""

import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from refimpl.data import TextTask, read_code_points, tokenize, tokenize_naive

NON_ASCII = "Grüße, naïve café: 5 € — Ωμέγα 𝄞\tend\n"


def old_text_task(path, seq_len, seed=0):
    """TextTask's loading before it was vectorised (and before decoding was strict)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    chars = sorted(set(text))
    lookup = {c: i for i, c in enumerate(chars)}
    return chars, np.array([lookup[c] for c in text], dtype=np.int64)


@pytest.mark.parametrize("text", [
    "hello world, " * 20,
    NON_ASCII * 7,
    "a",
    "".join(chr(c) for c in range(32, 32 + 300)) * 2,  # 300 characters: ids beyond uint8
    "\U0010ffff\x00z\u00e9",  # the largest and the smallest code point
], ids=["ascii", "non-ascii", "one-character", "300-characters", "extremes"])
def test_tokenize_equals_the_per_character_loop(text):
    chars, ids = tokenize(np.frombuffer(text.encode("utf-32-le"), dtype="<u4"))
    naive_chars, naive_ids = tokenize_naive(text)
    assert chars == naive_chars == sorted(set(text))
    assert np.array_equal(ids, naive_ids) and ids.dtype.kind == "u"
    assert ids.dtype.itemsize == (1 if len(chars) <= 256 else 2)


def test_tokenize_of_nothing():
    chars, ids = tokenize(np.zeros(0, dtype=np.uint8))
    assert chars == [] and len(ids) == 0


@pytest.mark.parametrize("body", [NON_ASCII * 30, "ascii only\n" * 60], ids=["non-ascii", "ascii"])
@pytest.mark.parametrize("newline", ["\n", "\r\n", "\r"], ids=["lf", "crlf", "cr"])
def test_text_task_gives_the_old_vocabulary_ids_and_batches(tmp_path, body, newline):
    path = tmp_path / "text.txt"
    path.write_bytes(body.replace("\n", newline).encode("utf-8") + b"last\r\nline\rend")
    task = TextTask(str(path), seq_len=16, seed=3)
    chars, ids = old_text_task(str(path), 16)
    assert task.chars == chars and np.array_equal(task.data, ids)
    assert "\r" not in task.chars  # newlines translated as text mode did
    reference = TextTask.__new__(TextTask)  # the old arrays inside the same windowing code
    reference.__dict__.update(task.__dict__, data=ids)
    for ours, theirs in [(task.batch(5, 4), reference.batch(5, 4)), (task.eval_batch(8), reference.eval_batch(8))]:
        for a, b in zip(ours, theirs):
            assert a.dtype == np.int64 and np.array_equal(a, b)
    assert task.decode(task.data[:40]) == "".join(chars[i] for i in ids[:40])


@pytest.mark.parametrize("content,offset,byte", [
    (b"hello\xff world" * 10, 5, "0xff"),
    ("é".encode() * 1000 + b"\xe9t\xe9" + b"x" * 100, 2000, "0xe9"),  # Latin-1 inside UTF-8 text
    (b"plain ascii text " * 10 + "€".encode()[:2], 170, "0xe2"),  # truncated at the end
])
def test_non_utf8_bytes_are_an_error_with_the_offset(tmp_path, content, offset, byte):
    path = tmp_path / "latin1.txt"
    path.write_bytes(content)
    with pytest.raises(ValueError) as error:
        TextTask(str(path), seq_len=8)
    message = str(error.value)
    assert f"is not UTF-8 text: byte {byte} at offset {offset} " in message
    assert "iconv" in message and "\n" not in message


def run_train(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "refimpl", "train", *args, "--steps", "1"],
                          capture_output=True, text=True, timeout=timeout)


def test_a_binary_file_is_a_one_line_error_from_train(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(range(256)) * 4)
    done = run_train("--data", str(path))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"error: text file {str(path)!r} is not UTF-8 text: byte 0x80 at offset 128 (invalid start byte); "
        "convert it to UTF-8 (e.g. iconv -f LATIN1 -t UTF-8 FILE > FILE.txt) or give a UTF-8 text file"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_is_named_and_never_opened(tmp_path):
    fifo = tmp_path / "stream"
    os.mkfifo(fifo)
    done = run_train("--data", str(fifo), timeout=60)  # opening it would wait for a writer forever
    assert done.returncode == 2
    assert f"text file {str(fifo)!r} is a FIFO (named pipe), not a regular file" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero")
def test_a_device_is_named():
    with pytest.raises(ValueError, match="'/dev/zero' is a character device, not a regular file"):
        read_code_points("/dev/zero")


def test_a_socket_is_named(tmp_path):
    path = tmp_path / "s"
    if len(str(path)) > 100 or not hasattr(socket, "AF_UNIX"):
        pytest.skip("no Unix socket at this path")
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(path))
        with pytest.raises(ValueError, match="is a socket, not a regular file"):
            read_code_points(str(path))


def test_missing_files_and_directories_keep_their_messages(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist$"):
        read_code_points(str(tmp_path / "missing.txt"))
    os.symlink(tmp_path / "gone.txt", tmp_path / "link.txt")
    with pytest.raises(FileNotFoundError, match="does not exist .a symbolic link to .*gone.txt'"):
        read_code_points(str(tmp_path / "link.txt"))
    with pytest.raises(ValueError, match="is a directory; give --data a text file"):
        read_code_points(str(tmp_path))


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_file_is_a_one_line_error(tmp_path):
    path = tmp_path / "secret.txt"
    path.write_text("text " * 40)
    path.chmod(0)
    with pytest.raises(ValueError, match="cannot read text file .*: Permission denied"):
        read_code_points(str(path))
