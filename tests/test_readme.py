"""README.rst's promises that a test can hold: its example runs and learns at 2 ranks, its links
lead to pages that exist, and it stays short (the detail lives in docs/)."""

import re
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.rst").read_text()


def block_after(marker):
    """The code block after the comment line ``.. <marker>``, dedented."""
    lines = README.splitlines()
    start = lines.index(f".. {marker}")
    body, inside = [], False
    for line in lines[start + 1:]:
        if line.startswith(".. code-block::"):
            inside = True
            continue
        if inside and line.strip() and not line[0].isspace():
            break
        if inside:
            body.append(line)
    return textwrap.dedent("\n".join(body)).strip() + "\n"


def test_the_example_trains_at_two_ranks(launch, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(block_after("example"))
    result = launch([sys.executable, str(script)], nprocs=2, timeout=120)
    assert not result.failed, result.output
    losses = {int(r): float(v) for r, v in re.findall(r"rank (\d): loss ([0-9.]+)", result.stdout)}
    assert sorted(losses) == [0, 1], result.output
    # the target's variance is 8: a model that did not learn stays near it
    assert all(loss < 0.5 for loss in losses.values()), losses


def test_the_links_lead_to_pages_that_exist():
    links = re.findall(r"<([^<>]+\.rst)>`_", README)
    assert links
    for link in links:
        assert (ROOT / link).exists(), link


@pytest.mark.parametrize("marker", ["main-command", "test-command"])
def test_the_two_commands_are_there(marker):
    assert block_after(marker).startswith("python3 -m venv .venv && . .venv/bin/activate")


def test_the_readme_stays_short():
    assert len(README.splitlines()) < 200
