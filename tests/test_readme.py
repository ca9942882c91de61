"""The README's first lines are the two commands, and CI runs the same test command."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _first_commands() -> list[str]:
    lines = (ROOT / "README.md").read_text().splitlines()
    start = lines.index("```bash")
    end = lines.index("```", start + 1)
    return [line.split("#")[0].strip() for line in lines[start + 1 : end]]


def test_readme_opens_with_the_train_and_test_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert lines.index("```bash") <= 3, "the two commands must be the README's first lines"
    assert _first_commands() == ["uv run mt-train pretrain", "uv run pytest"]


def test_ci_runs_the_readme_test_command():
    ci = [
        line.strip()
        for line in (ROOT / ".ci/run").read_text().splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]
    assert ci[-1] == _first_commands()[1]
