"""The fine-tuning notebooks run end to end in a real Jupyter kernel: base model, fine-tune on 4
forked ranks, the weights back in the notebook (samples and validation loss before and after), an
export that loads back equal; and no cell prints a warning."""

import os
import signal
from contextlib import suppress
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from printed import warning_lines

NOTEBOOKS = Path(__file__).resolve().parents[2] / "examples" / "notebooks"
#: What each notebook must print: the export's check, and lines found before and after the fine-tune.
CHECKS = {
    "finetune.ipynb": ["export equals the fine-tuned model: True", "lightning_canzona plan on mesh (2, 2)"],
    "finetune_transformers.ipynb": [
        "export gives the fine-tuned model's logits: True",
        "data_parallel 2 × tensor_parallel 2",
    ],
}


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_a_finetuning_notebook_runs_in_a_kernel(tmp_path, name) -> None:
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    # The kernel runs in a session of its own, and its forked ranks join its process group.
    kernel_group: list[int] = []
    client = NotebookClient(
        notebook,
        timeout=600,  # per cell; each notebook takes under 30 s here
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
    for check in CHECKS[name]:
        assert check in outputs, (check, outputs[-3000:])
    # Every cell's output, the forked ranks' included (the kernel forwards their output).
    assert not warning_lines(outputs), outputs[-3000:]
    # The fine-tuned model, back in the notebook, does better than the base model on held-out text.
    losses = {when: float(outputs.split(f"{when}: val_loss=")[1].split()[0]) for when in ("before", "after")}
    assert losses["after"] < losses["before"]
    samples = {when: outputs.split(f"{when}: '")[1].split("'\n")[0] for when in ("before", "after")}
    assert samples["after"] != samples["before"]
