"""The README's two set-up commands are the ones CI runs."""

from helpers import ROOT


def test_ci_runs_the_readme_commands():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    install = 'pip install -e ".[dev]" && python -m launch.server --true-on-policy --dry-run'
    assert install in readme and install in ci
    assert "\n    pytest\n" in readme and "\npytest\n" in ci
