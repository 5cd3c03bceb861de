"""The course's syllabus table and model answers, computed from the tutorials themselves.

Launch:  python tutorials/syllabus.py            # the table of docs/course.md (Markdown)
         python tutorials/syllabus.py --answers  # the model answers of the written questions
         python tutorials/syllabus.py --counts   # the course's counts, as one sentence
         python tutorials/syllabus.py --exercises  # each exercise's minutes, by the rule below

Study time per tutorial = reading + running + exercises, each estimated by one rule for every
tutorial, so that the estimates compare:

    reading    the words of its prose (the comment lines) at READING_WPM words per minute, and its
               code lines at CODE_LINES_PER_MINUTE (code is read more slowly than prose)
    running    RUN_MINUTES: the tutorial run once with the reference solutions on a 2-core
               machine, rounded up to whole minutes (`REFIMPL_TUTORIAL_SOLUTIONS=1 python
               tutorials/NN_name.py`; the one figure here that depends on the machine)
    exercises  per exercise, by the size of its reference solution, so that a one-liner and a
               modelling task are not both "20 minutes": EXERCISE_BASE_MINUTES to read the task and
               run the check, plus MINUTES_PER_STATEMENT for each statement of the solution's function
               and of the solution file's helpers it calls (the ast's statements: a line of
               arithmetic is one, a loop is one plus its body), plus DERIVATION_MINUTES where
               course.toml marks the exercise `derivation = true` (a closed form to find: short
               code, long thought), rounded up to 5 minutes; where the solutions are absent (the
               student copy), EXERCISE_MINUTES each.
               QUESTION_MINUTES per written question.

Everything else in the table (objectives, prerequisites, papers) is stated in SYLLABUS below; the
library files are the `refimpl/...` paths each tutorial names.
"""

from __future__ import annotations

import argparse
import ast
import math
import re
import sys
import tomllib
from pathlib import Path

HERE = Path(__file__).resolve().parent
READING_WPM = 150  # technical prose, read to understand rather than skimmed
CODE_LINES_PER_MINUTE = 10
EXERCISE_MINUTES = 20
EXERCISE_BASE_MINUTES = 5
MINUTES_PER_STATEMENT = 2
DERIVATION_MINUTES = 15
QUESTION_MINUTES = 15
# Measured once on a 2-core machine (2026-12-03) with the reference solutions: every tutorial ran
# in 0.2 to 12 s (09 and 12, which launch mpiexec, the longest); rounded up to whole minutes.
RUN_MINUTES = {"01": 1, "02": 1, "03": 1, "04": 1, "05": 1, "06": 1, "07": 1, "08": 1, "09": 1, "10": 1, "11": 1,
               "12": 1, "13": 1, "14": 1, "15": 1}

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
    "13": ("record a forward graph, find its articulation points, choose checkpoints by the gradient-"
           "checkpointing package's rules (memory, speed) and by a rule of your own; measure memory and "
           "recomputation", "01, 06", "Salimans and Bulatov 2018 (gradient-checkpointing); Chen et al. 2016, §4"),
    "14": ("split a sequence over C ranks: write the online-softmax merge, the load-balanced chunk assignment "
           "and the causal work per rank; count ring attention's bytes with and without the causal skip; "
           "compare the ring with Ulysses", "02, 03, 10",
           "Liu et al. 2023 (ring attention); Jacobs et al. 2023 (DeepSpeed-Ulysses); Dao et al. 2022 "
           "(FlashAttention), §3.1"),
    "15": ("the Llama block: write rotary position embeddings and derive why scores depend only on the "
           "offset n − m; derive the key/value bytes grouped-query attention saves and measure what it does not "
           "save; count a Llama block's parameters (RMSNorm, SwiGLU)", "01, 02",
           "Su et al. 2021 (RoFormer), §3.2; Ainslie et al. 2023 (GQA), §2.2; Shazeer 2020 (GLU variants), §2; "
           "Zhang and Sennrich 2019 (RMSNorm)"),
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


def solution_statements(tutorial: str) -> dict[str, int]:
    """{exercise function: statements of its reference solution and the helpers it calls}; {} without
    the solutions (the student copy)."""
    path = HERE / "solutions" / f"{tutorial}.py"
    if not path.is_file():
        return {}
    defs = {n.name: n for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)}

    def size(name: str, seen: set) -> int:
        seen.add(name)
        node = defs[name]
        count = sum(isinstance(n, ast.stmt) for n in ast.walk(node)) - 1  # the def itself not counted
        called = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} & defs.keys()
        return count + sum(size(c, seen) for c in called - seen)

    return {name: size(name, set()) for name in defs if not name.startswith("_")}


def exercise_minutes(tutorial: str, functions: list[str]) -> list[int]:
    """Each exercise's minutes, by the rule in this module's docstring."""
    sizes = solution_statements(tutorial)
    if not sizes:
        return [EXERCISE_MINUTES] * len(functions)
    marked = course_settings().get("exercise", {})
    derive = [DERIVATION_MINUTES if marked.get(f"{tutorial[:2]}.{k}", {}).get("derivation") else 0
              for k in range(1, len(functions) + 1)]
    return [5 * math.ceil((EXERCISE_BASE_MINUTES + MINUTES_PER_STATEMENT * sizes.get(f, 0) + extra) / 5)
            for f, extra in zip(functions, derive)]


def exercise_functions(path: Path) -> list[str]:
    """The exercise functions of a tutorial, in order (its `ex.check(N, check, function)` calls)."""
    calls = re.findall(r"^ex\.check\((\d+), \w+, (\w+)\)", path.read_text(), re.M)
    return [name for _, name in sorted(calls, key=lambda c: int(c[0]))]


def minutes(number: str, m: dict, path: Path | None = None) -> dict:
    reading = math.ceil(m["words"] / READING_WPM + m["code"] / CODE_LINES_PER_MINUTE)
    each = exercise_minutes(path.stem, exercise_functions(path)) if path is not None else [
        EXERCISE_MINUTES] * m["exercises"]
    work = sum(each) + QUESTION_MINUTES * m["questions"]
    run = RUN_MINUTES.get(number, 1)
    return {"reading": reading, "run": run, "exercises": work, "each": each, "total": reading + run + work}


def table() -> str:
    rows = ["| tutorial | you will | needs | reading | run | exercises | total | library files | papers |",
            "|---|---|---|---:|---:|---:|---:|---|---|"]
    for path in tutorials():
        number = path.name[:2]
        m = measure(path)
        t = minutes(number, m, path)
        goals, needs, papers = SYLLABUS[number]
        files = ", ".join(f"`{f}`" for f in m["files"][:4]) + (" …" if len(m["files"]) > 4 else "")
        work = f"{t['exercises']} min ({m['exercises']} exercises: {' + '.join(map(str, t['each']))}" + (
            f", {m['questions']} question{'s' if m['questions'] > 1 else ''})" if m["questions"] else ")")
        rows.append(f"| [{path.stem}](tutorials/{path.stem}.md) | {goals} | {needs} | {t['reading']} min | "
                    f"{t['run']} min | {work} | **{t['total']} min** | {files} | {papers} |")
    total = sum(minutes(p.name[:2], measure(p), p)["total"] for p in tutorials())
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


def course_settings() -> dict:
    path = HERE / "course.toml"
    if not path.is_file():
        return {}
    with open(path, "rb") as handle:
        return tomllib.load(handle)


def counts() -> str:
    """The course's counts as one sentence, from the tutorials and course.toml (never typed)."""
    settings = course_settings()
    default = settings.get("course", {}).get("default_points", 1)
    listed = [(p.stem[:2], i + 1) for p in tutorials() for i, _ in enumerate(exercise_functions(p))]
    points = sum(settings.get("exercise", {}).get(f"{t}.{k}", {}).get("points", default) for t, k in listed)
    questions = sum(measure(p)["questions"] for p in tutorials())
    question_points = sum(q.get("points", 0) for q in settings.get("question", {}).values())
    capstones = [k for k in ("schedule", "trainer") if k in settings.get("capstone", {})]
    hours = math.ceil(sum(minutes(p.name[:2], measure(p), p)["total"] for p in tutorials()) / 60)
    return (f"{len(tutorials())} tutorials, {len(listed)} exercises ({points:g} points), {questions} written "
            f"questions ({question_points:g} points) and {len(capstones)} capstones "
            f"({' or '.join(capstones)}); about {hours} hours of study, capstone not included.")


def exercise_table() -> str:
    rows = ["| exercise | function | statements in the solution | minutes |", "|---|---|---:|---:|"]
    for path in tutorials():
        functions = exercise_functions(path)
        sizes = solution_statements(path.stem)
        for k, (name, each) in enumerate(zip(functions, exercise_minutes(path.stem, functions)), start=1):
            rows.append(f"| {path.stem[:2]}.{k} | `{name}` | {sizes.get(name, '')} | {each} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--answers", action="store_true", help="the model answers instead of the table")
    p.add_argument("--counts", action="store_true", help="the course's counts, as one sentence")
    p.add_argument("--exercises", action="store_true", help="each exercise's estimated minutes")
    args = p.parse_args(argv)
    missing = [path.name for path in tutorials() if path.name[:2] not in SYLLABUS]
    if missing and not (args.counts or args.exercises or args.answers):  # only the table needs SYLLABUS
        print(f"error: no syllabus entry for {', '.join(missing)}: add it to SYLLABUS in tutorials/syllabus.py",
              file=sys.stderr)
        return 2
    print(answers() if args.answers else counts() if args.counts else exercise_table() if args.exercises
          else table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
