"""`python -m refimpl --help`: its description line names every command of cli.COMMANDS."""

import os
import subprocess
import sys

from refimpl import cli


def test_help_description_lists_every_command():
    result = subprocess.run([sys.executable, "-m", "refimpl", "--help"], capture_output=True, text=True,
                            timeout=120, env=dict(os.environ, COLUMNS="200"))
    assert result.returncode == 0, result.stderr
    description = result.stdout.splitlines()[2]  # usage line, blank line, description
    assert description == "Commands: " + ", ".join(cli.COMMANDS) + "."
    assert "consolidate" in description  # the one the hand-written line forgot


def test_description_follows_the_commands_that_are_there():
    assert cli.description(["train", "verify"]) == "Commands: train, verify."
    assert cli.build_parser().description == "Commands: " + ", ".join(cli.COMMANDS) + "."


def test_commands_live_in_refimpl_commands_and_nowhere_else_parses_flags():
    """Issue 15, item 4: the command-line code is refimpl/tools/commands/ (and cli.py, which dispatches);
    the libraries and algorithm packages hold no argparse and print no JSON summaries."""
    from pathlib import Path  # noqa: PLC0415

    assert all(module.startswith("refimpl.tools.commands.") for module, _ in cli.COMMANDS.values())
    package = Path(cli.__file__).parent
    scripts = {"checkpointing/report.py": "prints the tables of docs/checkpointing.md (python -m refimpl.tools.checkpoint_tables)"}
    parsing, printing = [], []
    for path in sorted(package.rglob("*.py")):
        name = path.relative_to(package).as_posix()
        if name.startswith("commands/") or name in ("cli.py", "console.py") or name in scripts:
            continue
        text = path.read_text()
        if "import argparse" in text or "from argparse" in text:
            parsing.append(name)
        if "emit_json" in text:
            printing.append(name)
    assert not parsing, f"argparse outside refimpl/tools/commands/: {parsing}"
    assert not printing, f"JSON summaries printed outside refimpl/tools/commands/: {printing}"
