"""The README's two opening commands are the ones CI and users run."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _commands():
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```bash\n(.+?)\n```", text, flags=re.S)


def test_readme_opens_with_demo_and_test_commands():
    demo, tests = _commands()[:2]
    assert "pip install -e '.[mpi]'" in demo and "python -m refimpl train" in demo
    assert "pip install -e '.[test]'" in tests and "pytest" in tests


def test_ci_runs_the_readmes_test_command():
    install_and_test = _commands()[1].split("&& ", 2)[2]  # after creating and activating the venv
    assert install_and_test in (ROOT / ".ci" / "run").read_text()
