"""docs/compatibility.md is what scripts/make_compat_docs.py renders from the table now.

Fails when kvjax/engine/compat.py changed without a regeneration:

    .venv/bin/python scripts/make_compat_docs.py
"""

from __future__ import annotations

import difflib
import pathlib

from kvjax.engine import compat

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_compatibility_matrix_is_up_to_date():
    generated = compat.render_markdown()
    written = (REPO / "docs" / "compatibility.md").read_text()
    diff = list(difflib.unified_diff(written.splitlines(), generated.splitlines(),
                                     "docs/compatibility.md", "generated", lineterm="", n=1))
    assert not diff, ("docs/compatibility.md is out of date; run .venv/bin/python "
                      "scripts/make_compat_docs.py\n" + "\n".join(diff[:40]))


def test_every_refusal_appears_with_its_reason():
    text = compat.render_markdown()
    for reason in set(compat.REFUSED.values()):
        assert f"{reason[0].upper()}{reason[1:]}." in text
