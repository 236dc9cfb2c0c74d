"""The fine-tuning notebook runs end to end in a real Jupyter kernel."""

import os
import signal
from contextlib import suppress
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "notebooks" / "finetune.ipynb"


def test_finetuning_notebook_runs_in_a_kernel(tmp_path) -> None:
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    # The kernel runs in a session of its own, and its forked ranks join its process group.
    kernel_group: list[int] = []
    client = NotebookClient(
        notebook,
        timeout=600,  # per cell; the whole notebook takes about 6 minutes on 2 busy cores
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
        on_notebook_start=lambda **_: kernel_group.append(client.km.provisioner.pgid),
    )
    try:
        client.execute()
    finally:
        # Whatever happened to the kernel, none of its ranks may outlive the test.
        for group in kernel_group:
            if group is None or group == os.getpgrp():  # not a group of the kernel's own
                continue
            with suppress(ProcessLookupError, PermissionError):
                os.killpg(group, signal.SIGKILL)
    outputs = "".join(
        output.get("text", "")
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.outputs
    )
    assert "after pre-training: val_loss=" in outputs
    assert "fine-tuned: train_loss=" in outputs
    assert "lightning_canzona plan on mesh (2, 2)" in outputs
