"""Executes every notebook under notebooks/ on the CPU; a failing cell fails the test."""

import os
import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
@pytest.mark.slow
def test_notebook_runs(path, tmp_path, monkeypatch):
  nb = nbformat.read(path, as_version=4)
  # The kernel inherits these; monkeypatch restores them after the test.
  repo_root = str(path.parent.parent)
  monkeypatch.setenv("PYTHONPATH", repo_root + os.pathsep + os.environ.get("PYTHONPATH", ""))
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.setenv("MPLBACKEND", "Agg")
  NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
  assert not errors
