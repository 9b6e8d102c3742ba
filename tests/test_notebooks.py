"""Executes every colab/*.ipynb headless, top to bottom, in fast mode (KVJAX_NOTEBOOK_FAST=1).

The kernel is this interpreter (a kernel spec written to a temporary directory), so the
notebooks import the kvjax under test. A notebook passes when no cell raises and every
plotting cell it has produced at least one PNG figure.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

REPO = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((REPO / "colab").glob("*.ipynb"))
KERNEL_NAME = "kvjax-notebook-test"
CELL_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def kernel_env(tmp_path_factory):
    """Environment whose Jupyter path holds a kernel spec running sys.executable."""
    root = tmp_path_factory.mktemp("jupyter")
    spec_dir = root / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    spec = dict(argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                display_name="kvjax test kernel", language="python")
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    old = {k: os.environ.get(k) for k in ("JUPYTER_PATH", "KVJAX_NOTEBOOK_FAST", "MPLBACKEND")}
    os.environ["JUPYTER_PATH"] = os.pathsep.join(
        p for p in (str(root), old["JUPYTER_PATH"]) if p)
    os.environ["KVJAX_NOTEBOOK_FAST"] = "1"
    os.environ.pop("MPLBACKEND", None)
    yield
    for key, value in old.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _execute(path: pathlib.Path) -> nbformat.NotebookNode:
    """The notebook executed, plus a last cell printing the kernel's interpreter and kvjax."""
    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(
        "import sys, kvjax; print(sys.executable); print(kvjax.__file__)"))
    client = nbclient.NotebookClient(
        nb, kernel_name=KERNEL_NAME, timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    return nb


def test_notebooks_match_their_generator():
    """colab/*.ipynb are what scripts/make_notebooks.py writes now (it embeds
    configs/serve_default.py, so a change there needs a regeneration too)."""
    spec = importlib.util.spec_from_file_location("make_notebooks",
                                                  REPO / "scripts" / "make_notebooks.py")
    make_notebooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_notebooks)
    stale = [name for name, cells in make_notebooks.NOTEBOOKS.items()
             if nbformat.writes(make_notebooks.build_notebook(cells))
             != nbformat.writes(nbformat.read(REPO / "colab" / name, as_version=4))]
    assert not stale, f"{stale} are stale: run .venv/bin/python scripts/make_notebooks.py"


def test_notebooks_exist():
    names = {p.name for p in NOTEBOOKS}
    assert {"01_quickstart.ipynb", "02_paged_vs_contiguous.ipynb",
            "03_quantization_tradeoffs.ipynb", "04_write_your_own_policy.ipynb",
            "05_rl_rollouts.ipynb"} <= names


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_in_fast_mode(path, kernel_env):
    nb = _execute(path)
    *code, probe = [c for c in nb.cells if c.cell_type == "code"]
    for cell in code:
        errors = [o for o in cell.outputs if o.get("output_type") == "error"]
        assert not errors, f"{path.name}: {errors[0]['ename']}: {errors[0]['evalue']}"
    plotting = [c for c in code if "plt.subplots" in c.source]
    assert plotting, f"{path.name} draws no figure"
    for cell in plotting:
        images = [o for o in cell.outputs if "image/png" in o.get("data", {})]
        assert images, f"{path.name}: a plotting cell produced no PNG:\n{cell.source[:200]}"
    # The kernel ran this interpreter and the kvjax under test (the install cell was skipped).
    executable, kvjax_file = probe.outputs[0]["text"].split()
    assert pathlib.Path(executable).resolve() == pathlib.Path(sys.executable).resolve()
    assert pathlib.Path(kvjax_file).resolve().is_relative_to(REPO / "kvjax")
