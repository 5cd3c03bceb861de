"""The map of the package for docs/design.md: every module with its line count and what it is.

Launch: python docs/module_map.py core|tools|reading

    core     the teaching core's modules, one row each: path, lines, the first line of its docstring
    tools    the same for refimpl/tools/
    reading  the reading path: for each algorithm, the file to open first and the ones to read next

docs/generate.py writes the output into docs/design.md, so the map cannot go stale: a module
without a docstring, or a reading path that names a file that does not exist, is an error here.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "refimpl"

# For each algorithm: the file a student opens first, then the ones it leads to (in reading order).
READING_PATH = [
    ("reverse-mode autograd", ["autograd/tensor.py", "autograd/function.py", "autograd/ops.py", "autograd/engine.py"]),
    ("layers and the GPT", ["nn/module.py", "nn/functional.py", "nn/layers.py", "nn/models.py"]),
    ("the loss of a global batch", ["objective.py", "local_trainer.py"]),
    ("optimizers and mixed precision", ["optim/adamw.py", "optim/clip.py", "optim/precision.py"]),
    ("activation checkpointing", ["checkpointing/checkpoint.py", "checkpointing/plans.py", "checkpointing/revolve.py",
                                  "checkpointing/sequential.py"]),
    ("collectives and their bytes", ["parallel/comm.py", "parallel/ring.py"]),
    ("data parallelism (DDP)", ["parallel/data_parallel.py"]),
    ("what ZeRO partitions, and its formulas", ["parallel/zero/__init__.py", "memory.py"]),
    ("ZeRO-1", ["parallel/zero/stage1.py", "parallel/zero/strategy.py", "parallel/zero/reductions.py",
                "parallel/zero/flat.py", "parallel/zero/optimizer.py"]),
    ("ZeRO-2", ["parallel/zero/stage2.py", "parallel/zero/buffers.py", "parallel/zero/reductions.py"]),
    ("ZeRO-3", ["parallel/zero/stage3.py", "parallel/zero/buffers.py", "parallel/zero/reductions.py",
                "parallel/zero/flat.py"]),
    ("tensor and sequence parallelism", ["parallel/tensor_parallel/operators.py", "parallel/tensor_parallel/layers.py",
                                         "parallel/tensor_parallel/gpt.py", "parallel/tensor_parallel/communication.py",
                                         "memory.py"]),
    ("mixture of experts and expert parallelism", ["nn/experts.py", "parallel/experts.py"]),
    ("pipeline schedules", ["parallel/pipeline/actions.py", "parallel/pipeline/schedules/one_f_one_b.py",
                            "parallel/pipeline/schedules/zb1p.py", "parallel/pipeline/schedules/dualpipe.py",
                            "parallel/pipeline/validate.py", "parallel/pipeline/simulate.py"]),
    ("running a pipeline over MPI", ["parallel/pipeline/executor.py", "parallel/pipeline/overlap.py",
                                     "parallel/pipeline/stage.py"]),
    ("one trainer over the pp x dp x tp mesh", ["parallel/trainer.py", "parallel/mesh.py", "protocols.py"]),
    ("DualPipe's overlapped F&B with experts", ["parallel/pipeline/schedules/dualpipe.py",
                                               "parallel/pipeline/executor.py", "parallel/pipeline/overlap.py",
                                               "parallel/experts.py", "nn/experts.py"]),
]


ENTRY_POINT = PACKAGE / "__main__.py"  # `python -m refimpl`: listed with the tools


def modules(under: Path, skip: Path | None = None) -> list[Path]:
    return sorted(p for p in under.rglob("*.py") if (skip is None or skip not in p.parents) and p != ENTRY_POINT)


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def summary(path: Path) -> str:
    docstring = ast.get_docstring(ast.parse(path.read_text()))
    if not docstring:
        raise SystemExit(f"{path.relative_to(ROOT)} has no docstring: say what the module is")
    paragraph = " ".join(docstring.strip().split("\n\n")[0].split())
    sentence = paragraph.split(". ")[0].rstrip(".")
    return sentence.replace("|", "\\|")


def table(paths: list[Path]) -> str:
    rows = ["| module | lines | what it is |", "|---|---:|---|"]
    rows += [f"| `{p.relative_to(ROOT)}` | {lines(p)} | {summary(p)} |" for p in paths]
    total = sum(lines(p) for p in paths)
    return "\n".join(rows) + f"\n\n{len(paths)} modules, {total} lines."


def reading_path() -> str:
    rows = ["| to learn | open first | then | lines in all |", "|---|---|---|---:|"]
    for topic, files in READING_PATH:
        paths = [PACKAGE / f for f in files]
        for path in paths:
            if not path.is_file():
                raise SystemExit(f"the reading path of {topic!r} names {path.relative_to(ROOT)}, which does not exist")
        first, *rest = files
        then = ", ".join(f"`{f}` ({lines(PACKAGE / f)})" for f in rest) or "-"
        rows.append(f"| {topic} | `{first}` ({lines(PACKAGE / first)}) | {then} | {sum(lines(p) for p in paths)} |")
    return "\n".join(rows) + "\n\nPaths are under `refimpl/`; the figures in parentheses are line counts."


def main(argv: list[str]) -> int:
    if argv == ["core"]:
        print(table(modules(PACKAGE, skip=PACKAGE / "tools")))
    elif argv == ["tools"]:
        print(table([ENTRY_POINT, *modules(PACKAGE / "tools")]))
    elif argv == ["reading"]:
        print(reading_path())
    else:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
