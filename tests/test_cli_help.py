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
