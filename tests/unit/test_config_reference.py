"""docs/config.md is what scripts/config_reference.py renders from the schemas now: a changed option, default or
docstring fails here until the page is regenerated."""

import subprocess
import sys

from tests.conftest import REPO


def test_the_config_reference_is_current() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts/config_reference.py"), "--check"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr


def test_every_command_has_its_section() -> None:
    from tidal.cli import COMMANDS

    page = (REPO / "docs/config.md").read_text()
    assert all(f"## tidal {name}\n" in page for name in COMMANDS)
    assert "  --trainer.optim.lr FLOAT" in page and "  --orchestrator.batch.group-size INT" in page
