"""Print the slow tier (tests/slow_tests.txt) from a run's `pytest --durations=0` output.

    python -m pytest -q --durations=0 > timings.txt; python tests/slow_tests.py timings.txt > tests/slow_tests.txt

A test is slow when its setup, call and teardown together took SLOW_S seconds or more; all the
parameter sets of a slow test are marked with it.
"""

import collections
import re
import sys
from pathlib import Path

SLOW_S = 1.0


def main(path: str) -> None:
    seconds = collections.Counter()
    for line in Path(path).read_text().splitlines():
        found = re.match(r"^([0-9.]+)s (call|setup|teardown)\s+(\S+)", line)
        if found:
            seconds[found.group(3).split("[")[0]] += float(found.group(1))
    header = [line for line in Path(__file__).with_suffix(".txt").read_text().splitlines() if line.startswith("#")]
    print("\n".join(header + sorted(test for test, s in seconds.items() if s >= SLOW_S)))


if __name__ == "__main__":
    main(sys.argv[1])
