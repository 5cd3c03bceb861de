"""`python -m refimpl --help`: its description line names every command of cli.COMMANDS."""

import os
import subprocess
import sys
from pathlib import Path

from refimpl.tools import cli


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


def test_commands_live_in_refimpl_tools_commands_and_nowhere_else_parses_flags():
    """The command-line code is refimpl/tools/commands/ with the flags they share (flags.py) and the
    dispatcher (cli.py); the rest of the tools and the whole core hold no argparse and print no JSON."""
    assert all(module.startswith("refimpl.tools.commands.") for module, _ in cli.COMMANDS.values())
    package = Path(cli.__file__).parents[1]  # refimpl/
    allowed = {"tools/cli.py", "tools/console.py", "tools/flags.py",
               "tools/checkpoint_tables.py"}  # a script: prints the tables of docs/checkpointing.md
    parsing, printing = [], []
    for path in sorted(package.rglob("*.py")):
        name = path.relative_to(package).as_posix()
        if name.startswith("tools/commands/") or name in allowed:
            continue
        text = path.read_text()
        if "import argparse" in text or "from argparse" in text:
            parsing.append(name)
        if "emit_json" in text:
            printing.append(name)
    assert not parsing, f"argparse outside refimpl/tools/commands/: {parsing}"
    assert not printing, f"JSON summaries printed outside refimpl/tools/commands/: {printing}"
