"""Loading a --data text file: the per-character Python loop against the vectorised encoding.

Launch:  python benchmarks/bench_text_loading.py [--mb 48] [--repeats 3] [--json]

Writes a text file of about --mb megabytes (a seeded stream of words, with newlines) twice: once
ASCII only, once with non-ASCII characters (accented letters, a euro sign, a character outside
the Basic Multilingual Plane), and loads each with

  old  what TextTask did before: a text-mode read with errors="replace", then data.tokenize_naive:
       sorted(set(text)) and np.array([lookup[c] for c in text]), a dictionary look-up per character;
  new  TextTask's loading now: data.read_code_points (strict UTF-8; an ASCII file's bytes are its
       code points) and data.tokenize (a histogram, a cumulative sum, one gather; no Python loop).

Both must give the same vocabulary and the same token ids (checked here, and in
tests/test_data_text.py). Reported: wall and CPU seconds of each (the new one: medians of --repeats)
and the ratios old / new, measured in one run. Target: the 48 MB file in well under a second.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from refimpl.data import read_code_points, tokenize, tokenize_naive

WORDS = ["the", "model", "sorts", "digits", "and", "learns", "a", "pipeline", "of", "ranks", "gradient", "step"]
NON_ASCII = ["café", "naïve", "Grüße", "€5", "𝄞", "Ωμέγα"]


def old_load(path: str):
    """TextTask's loading before the vectorised version (kept here to be timed)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    return tokenize_naive(text)


def new_load(path: str):
    return tokenize(read_code_points(path))


def write_text(path: Path, megabytes: float, words: list[str]) -> int:
    rng = np.random.default_rng(0)
    line = " ".join(words[i] for i in rng.integers(0, len(words), 4000)) + "\n"
    chunk = "".join(line[i:] + line[:i] for i in range(0, 400, 40)).encode("utf-8")  # about 250 kB
    repeats = max(1, int(megabytes * 1e6 // len(chunk)))
    path.write_bytes(chunk * repeats)
    return len(chunk) * repeats


def timed(fn, repeats: int):
    """(fn's result, wall seconds, CPU seconds), medians over `repeats` calls. CPU time is this
    process's: on a machine shared with other jobs it is the steadier figure."""
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        result = fn()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return result, statistics.median(wall), statistics.median(cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=48.0, help="file size in megabytes (default 48)")
    parser.add_argument("--repeats", type=int, default=3, help="timings of the new loading (median; default 3)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, words in (("ascii", WORDS), ("non-ascii", WORDS + NON_ASCII)):
            path = Path(tmp) / f"{name}.txt"
            size = write_text(path, args.mb, words)
            (chars, ids), new_s, new_cpu = timed(lambda: new_load(str(path)), args.repeats)
            (old_chars, old_ids), old_s, old_cpu = timed(lambda: old_load(str(path)), 1)  # once: it takes seconds
            same = chars == old_chars and np.array_equal(ids, old_ids)
            rows.append({"text": name, "bytes": size, "characters": len(ids), "vocabulary": len(chars),
                         "old_s": old_s, "new_s": new_s, "old_cpu_s": old_cpu, "new_cpu_s": new_cpu,
                         "ratio": old_s / new_s, "cpu_ratio": old_cpu / new_cpu, "same_result": same})
            print(f"{name:9s} {size / 1e6:5.1f} MB, {len(ids)} characters, vocabulary {len(chars):2d}: "
                  f"old {old_s:6.2f} s ({old_cpu:6.2f} s CPU), new {new_s:5.3f} s ({new_cpu:5.3f} s CPU), "
                  f"old/new {old_s / new_s:5.1f}x ({old_cpu / new_cpu:5.1f}x CPU); same vocabulary and ids: {same}")
    if args.json:
        print(json.dumps({"mb": args.mb, "results": rows}))


if __name__ == "__main__":
    main()
