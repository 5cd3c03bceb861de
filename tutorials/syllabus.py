"""The course's syllabus table and model answers, computed from the tutorials themselves.

Launch:  python tutorials/syllabus.py            # the table of docs/course.md (Markdown)
         python tutorials/syllabus.py --answers  # the model answers of the written questions

Study time per tutorial = reading + running + exercises, each estimated by one rule for every
tutorial, so that the estimates compare:

    reading    the words of its prose (the comment lines) at READING_WPM words per minute, and its
               code lines at CODE_LINES_PER_MINUTE (code is read more slowly than prose)
    running    RUN_MINUTES: the tutorial run once with the reference solutions on a 2-core
               machine, rounded up to whole minutes (`REFIMPL_TUTORIAL_SOLUTIONS=1 python
               tutorials/NN_name.py`; the one figure here that depends on the machine)
    exercises  EXERCISE_MINUTES per exercise, QUESTION_MINUTES per written question

Everything else in the table (objectives, prerequisites, papers) is stated in SYLLABUS below; the
library files are the `refimpl/...` paths each tutorial names.
"""

from __future__ import annotations

import argparse
import ast
import math
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
READING_WPM = 150  # technical prose, read to understand rather than skimmed
CODE_LINES_PER_MINUTE = 10
EXERCISE_MINUTES = 20
QUESTION_MINUTES = 15
# Measured once on a 2-core machine (2026-12-03) with the reference solutions: every tutorial ran
# in 0.2 to 12 s (09 and 12, which launch mpiexec, the longest); rounded up to whole minutes.
RUN_MINUTES = {"01": 1, "02": 1, "03": 1, "04": 1, "05": 1, "06": 1, "07": 1, "08": 1, "09": 1, "10": 1, "11": 1,
               "12": 1}

# number -> (objectives, prerequisites, papers and sections)
SYLLABUS = {
    "01": ("write a reverse-mode autograd engine and check it against refimpl's; order a graph "
           "topologically; split a backward into input (I) and weight (W) halves",
           "NumPy, the chain rule", "Baydin et al. 2018 (automatic differentiation survey), §3"),
    "02": ("build causal attention, a GPT and its loss from the engine's parts; count its "
           "parameters; account for the activations it saves", "01",
           "Vaswani et al. 2017, §3.2; Radford et al. 2019 (GPT-2), §2.3"),
    "03": ("derive the ring all-gather, reduce-scatter and all-reduce; count the bytes each rank "
           "sends, 2(N − 1)/N of the buffer; run them on MPI processes", "NumPy",
           "Patarasuk and Yuan 2009; Thakur, Rabenseifner and Gropp 2005, §4"),
    "04": ("see why the loss must be normalised by the global count for gradients to add up; "
           "build a data-parallel trainer, verify it against one process, overlap its all-reduce "
           "with backward in buckets", "02, 03", "Li et al. 2020 (PyTorch DDP), §3–4"),
    "05": ("compute model-state bytes per rank for ZeRO 1, 2, 3; shard a flat buffer; run a "
           "sharded optimizer step and watch the memory ledger", "04",
           "Rajbhandari et al. 2019 (ZeRO), §5, §7, Table 1"),
    "06": ("trade memory for recomputation: checkpoint a function, plan a chain (every-K, √n), "
           "and count revolve's optimum", "02", "Chen et al. 2016, §3–4; Griewank and Walther 2000 (revolve)"),
    "07": ("write schedules as data, simulate their bubble and memory, compare GPipe with 1F1B, "
           "see what the validator catches", "02",
           "Huang et al. 2019 (GPipe), §2; Narayanan et al. 2021, §2.2"),
    "08": ("split backward into I and W to fill the bubble (ZB-H1, ZB-H2, ZB-V); DualPipe's two "
           "directions; where the closed forms stop being exact", "01, 07",
           "Qi et al. 2023 (zero bubble), §2–3; DeepSeek-AI 2024 (V3), §3.2.1"),
    "09": ("place ranks on a pp × dp × tp mesh; know what each rank holds; verify data × "
           "pipeline parallelism with ZeRO and checkpointing; measure the bubble", "04–08",
           "Narayanan et al. 2021 (PTD-P), §3"),
    "10": ("cut a transformer layer over t ranks (column and row parallel, heads, vocabulary); "
           "write the conjugate operators f and g; sequence parallelism", "02, 03, 09",
           "Shoeybi et al. 2019 (Megatron-LM), §3; Korthikanti et al. 2022, §4"),
    "11": ("route tokens to experts (top-K), dispatch and combine them by all-to-all, and hide "
           "that communication behind computation (DualPipe's F&B)", "08, 10",
           "Shazeer et al. 2017; Fedus et al. 2021 (Switch), §2; DeepSeek-AI 2024 (V3), §3.2"),
    "12": ("predict memory per GPU and step time at 1024 GPUs by hand, check them against the "
           "cluster model and an executed run; MFU", "05, 06, 09, 10",
           "Chowdhery et al. 2022 (PaLM), appendix B; Korthikanti et al. 2022, §6"),
}


def tutorials() -> list[Path]:
    return sorted(p for p in HERE.glob("[0-9][0-9]_*.py"))


def measure(path: Path) -> dict:
    """Words of prose, code lines, exercises, written questions and refimpl files of a tutorial."""
    text = path.read_text()
    lines = text.splitlines()
    prose = [line[1:] for line in lines if line.startswith("#") and not line.startswith("# %%")]
    code = [line for line in lines if line.strip() and not line.startswith("#")]
    words = sum(len(line.split()) for line in prose)
    exercises = len(set(re.findall(r"\*\*Exercise (\d+)\.\*\*", text)))
    questions = len(re.findall(r"\*\*Question\b", text))
    files = sorted(set(re.findall(r"`(refimpl/[\w/]+(?:\.py)?/?)`", text)))
    return {"words": words, "code": len(code), "exercises": exercises, "questions": questions, "files": files}


def minutes(number: str, m: dict) -> dict:
    reading = math.ceil(m["words"] / READING_WPM + m["code"] / CODE_LINES_PER_MINUTE)
    work = EXERCISE_MINUTES * m["exercises"] + QUESTION_MINUTES * m["questions"]
    run = RUN_MINUTES.get(number, 1)
    return {"reading": reading, "run": run, "exercises": work, "total": reading + run + work}


def table() -> str:
    rows = ["| tutorial | you will | needs | reading | run | exercises | total | library files | papers |",
            "|---|---|---|---:|---:|---:|---:|---|---|"]
    for path in tutorials():
        number = path.name[:2]
        m = measure(path)
        t = minutes(number, m)
        goals, needs, papers = SYLLABUS[number]
        files = ", ".join(f"`{f}`" for f in m["files"][:4]) + (" …" if len(m["files"]) > 4 else "")
        work = f"{t['exercises']} min ({m['exercises']} exercises" + (
            f", {m['questions']} question{'s' if m['questions'] > 1 else ''})" if m["questions"] else ")")
        rows.append(f"| [{path.stem}](tutorials/{path.stem}.md) | {goals} | {needs} | {t['reading']} min | "
                    f"{t['run']} min | {work} | **{t['total']} min** | {files} | {papers} |")
    total = sum(minutes(p.name[:2], measure(p))["total"] for p in tutorials())
    rows += ["", f"In all about {math.ceil(total / 60)} hours of study, capstone not included."]
    return "\n".join(rows)


def answers() -> str:
    """The model answers (ANSWER strings) of the reference solutions, tutorial by tutorial."""
    out = []
    for path in sorted((HERE / "solutions").glob("[0-9][0-9]_*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "ANSWER" for t in node.targets):
                out.append(f"### {path.stem}\n\n" + "\n".join(
                    line for line in ast.literal_eval(node.value).strip().splitlines()))
    return "\n\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--answers", action="store_true", help="the model answers instead of the table")
    args = p.parse_args(argv)
    missing = [path.name for path in tutorials() if path.name[:2] not in SYLLABUS]
    if missing:
        print(f"error: no syllabus entry for {', '.join(missing)}: add it to SYLLABUS in tutorials/syllabus.py",
              file=sys.stderr)
        return 2
    print(answers() if args.answers else table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
