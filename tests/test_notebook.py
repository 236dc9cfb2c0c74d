"""The fine-tuning notebook runs end to end in a real Jupyter kernel."""

from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "notebooks" / "finetune.ipynb"


def test_finetuning_notebook_runs_in_a_kernel(tmp_path) -> None:
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    outputs = "".join(
        output.get("text", "")
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.outputs
    )
    assert "after pre-training: val_loss=" in outputs
    assert "fine-tuned: train_loss=" in outputs
    assert "lightning_canzona plan on mesh (2, 2)" in outputs
