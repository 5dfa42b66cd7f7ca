"""The research notebooks are kept in git without outputs, and each checks what it shows.

pytest executes them (nbmake, ``notebooks`` in the pyproject's testpaths); these checks read
their JSON only.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def test_the_readme_lists_every_notebook_and_no_other():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    listed = set(re.findall(r"^- `(\d\d_\w+\.ipynb)`:", readme, re.MULTILINE))
    assert NOTEBOOKS and listed == {p.name for p in NOTEBOOKS}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stored_without_outputs(path):
    cells = json.loads(path.read_text())["cells"]
    for i, cell in enumerate(cells):
        if cell["cell_type"] == "code":
            assert cell.get("outputs") == [], f"{path.name} cell {i} keeps outputs; clear them"
            assert cell.get("execution_count") is None, f"{path.name} cell {i}: clear its count"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_asserts_what_it_demonstrates(path):
    code = "\n".join(
        "".join(c["source"])
        for c in json.loads(path.read_text())["cells"]
        if c["cell_type"] == "code"
    )
    assert "assert" in code, f"{path.name} checks nothing; a broken notebook would pass"
