"""notebooks/: committed without outputs, and executed here (a real Jupyter kernel through nbclient) on small
settings that replace each notebook's cell tagged `parameters`."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import nbformat
import pytest
from conftest import REPO, read_summary
from nbclient import NotebookClient

import compare_runs

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


def execute(name: str, parameters: str, monkeypatch) -> nbformat.NotebookNode:
    notebook = nbformat.read(REPO / "notebooks" / name, as_version=4)
    cell = next(c for c in notebook.cells if "parameters" in c.metadata.get("tags", []))
    cell.source = f"from pathlib import Path\nREPO = Path({str(REPO)!r})\n{parameters}"
    monkeypatch.setenv("WANDB_MODE", "offline")  # the kernel inherits this process's environment
    monkeypatch.setenv("WANDB_SILENT", "true")
    NotebookClient(notebook, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(REPO / "notebooks")}}).execute()
    return notebook


def text_of(notebook) -> str:
    return "\n".join(str(out.get("text", "")) + str(out.get("data", {}).get("text/plain", ""))
                     for cell in notebook.cells if cell.cell_type == "code" for out in cell.outputs)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_committed_without_outputs(path):
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: strip outputs before committing"


@pytest.mark.slow
@pytest.mark.parametrize("script", ["train_cifar.py", "train_minimal.py", "train_vit.py"])
def test_launch_from_notebook_trains_each_script_with_two_processes_and_shows_the_result(
        script, cifar_dir, cache_dir, tmp_path, monkeypatch):
    out = tmp_path / "notebook_run"
    if script == "train_cifar.py":
        subsets, extra = (256, 64), ["--model", "resnet8", "--cache-dir", str(cache_dir), "--log-every", "5"]
    elif script == "train_vit.py":
        subsets, extra = (128, 32), ["--model", "vit_micro", "--cache-dir", str(cache_dir), "--log-every", "1"]
    else:  # no --cache-dir: with a read-only data folder it caches under $XDG_CACHE_HOME (the kernel inherits it)
        subsets, extra = (128, 32), []
        (tmp_path / "xdg").mkdir()
        (tmp_path / "xdg" / "accelerate-cifar").symlink_to(cache_dir, target_is_directory=True)
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    notebook = execute("launch_from_notebook.ipynb", f"SCRIPT = {script!r}\nDATA_DIR = {str(cifar_dir)!r}\n"
                       f"OUTPUT_DIR = {str(out)!r}\nTRAIN_SUBSET, EVAL_SUBSET = {subsets}\nEPOCHS = 1\n"
                       f"TRACKER = 'wandb'\nEXTRA_FLAGS = {extra!r}\nPORT = {free_port()}", monkeypatch)
    s = read_summary(out)
    assert (s["world_size"], s["epochs_completed"], s["eval_examples"]) == (2, 1, subsets[1])
    assert s["config"]["output_dir"] == str(out) and s["config"]["batch_size"] == 64
    shown = text_of(notebook)
    assert f"launching 2 processes of {script}" in shown
    assert f"test top-1 {s['eval_top1']:.2f}% on {subsets[1]} images" in shown
    assert len(list((out / "wandb").glob("offline-run-*"))) == 1
    [run] = compare_runs.load(str(out))  # the run's offline W&B files, whichever script wrote them
    assert run.metric(*compare_runs.COLUMNS["final top-1 %"]) == s["eval_top1"]
    built = s.get("model", s["config"]["model"])  # the templates record what they built; train_minimal, its flag
    assert run.config["model"] == built and len(compare_runs.points(run, "epoch", "eval/top1")) == 1


def free_port() -> int:
    """A port no process here listens on (the notebook's processes meet on it: not 29500, which a job beside the
    tests may hold)."""
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def test_compare_runs_notebook_shows_the_table_groups_and_plots(tracked_runs, tmp_path, monkeypatch):
    runs = [str(tracked_runs[name]) for name in ("a0", "a1", "b")]
    notebook = execute("compare_runs.ipynb", f"RUNS = {json.dumps(runs)}\nPLOTS = {str(tmp_path / 'plots')!r}",
                       monkeypatch)
    shown = text_of(notebook)
    for name in ("a0", "a1", "b"):
        assert f"{read_summary(tracked_runs[name])['eval_top1']:.2f}" in shown
    assert "config keys that differ:" in shown and "\nA " in shown and "+/-" in shown
    images = [out for cell in notebook.cells if cell.cell_type == "code"
              for out in cell.outputs if "image/png" in out.get("data", {})]
    assert len(images) == 4
    assert sorted(p.name for p in Path(tmp_path / "plots").glob("*.png")) == [
        "eval_top1_vs_epoch.png", "eval_top1_vs_wall_clock.png", "train_epoch_loss_vs_epoch.png",
        "train_loss_vs_step.png"]
