"""Writes docs/compatibility.md, the matrix of which KV behaviours compose, from the one table
in kvjax/engine/compat.py.

    .venv/bin/python scripts/make_compat_docs.py           # regenerate docs/compatibility.md
    .venv/bin/python scripts/make_compat_docs.py --check   # exit 1 if it is out of date

tests/test_compat_docs.py fails when the table changes without a regeneration.
"""

from __future__ import annotations

import pathlib
import sys

from absl import app, flags

from kvjax.engine import compat

COMPAT_MD = pathlib.Path(__file__).resolve().parent.parent / "docs" / "compatibility.md"

FLAGS = flags.FLAGS
flags.DEFINE_bool("check", False, "Exit 1 if docs/compatibility.md differs from the table.")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    text = compat.render_markdown()
    if FLAGS.check:
        if not COMPAT_MD.exists() or COMPAT_MD.read_text() != text:
            sys.exit(f"{COMPAT_MD} is out of date: run .venv/bin/python "
                     f"scripts/make_compat_docs.py")
        print(f"{COMPAT_MD} is up to date")
        return
    COMPAT_MD.write_text(text)
    print(f"wrote {COMPAT_MD} ({len(text.splitlines())} lines)")


if __name__ == "__main__":
    app.run(main)
