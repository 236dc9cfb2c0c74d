"""Host syncs of an optimizer step at dp2×tp2, counted as a GPU would feel them
(`lightning_canzona.tools.checks.HostSyncs`).

After warm-up steps (the plan built, state created), one step of each optimizer is counted: the
strategy's work after backward (the plain parameters' averaging and replica check), gradient
clipping where asked, and ``optimizer.step()``. A default step reads the device at most once (the
gradients' agreement, which carries the previous step's failure and the replica check); clipping
adds none. The same launch traces which of the package's files a default Muon step's calls pass
through: a step a maintainer can follow.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from multiprocess import run_on_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import lightning_canzona as lc
from lightning_canzona.distributed.clipping import clip_grad_norm_
from lightning_canzona.preparation import synchronise_unsharded
from lightning_canzona.tools.checks import HOST_SYNCS_PER_STEP, HostSyncs

#: Each optimizer, its settings (SOAP's decomposition every other step: steps 3 and 5 run one),
#: and the steps counted after the warm-up (1-based).
OPTIMIZERS = {
    "muon": (lc.Muon, {}, {"step": 3}),
    "normuon": (lc.NorMuon, {}, {"step": 3}),
    "soap": (lc.SOAP, {"precondition_frequency": 2}, {"step": 4, "decomposition step": 5}),
}
WARM_UP = 2
#: The package's files that a default Muon step (planned already) may pass through, at most.
STEP_FILES = 10
PACKAGE = Path(lc.__file__).parent


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 40)
        self.down = nn.Linear(40, 16)
        self.gate = nn.Linear(16, 12, bias=False)
        self.norm = nn.LayerNorm(16)
        self.experts = nn.Parameter(torch.randn(3, 8, 6) / 3)


def _model(mesh) -> tuple[nn.Module, nn.Parameter]:
    """A block at dp×tp (TP on its linears, FSDP2 over all), and a plain parameter beside it."""
    torch.manual_seed(0)
    model = Block()
    parallelize_module(
        model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel(), "gate": ColwiseParallel()}
    )
    fully_shard(model, mesh=mesh["dp"])
    return model, nn.Parameter(torch.ones(16))


def _gradients(step: int, named: list[tuple[str, nn.Parameter]]) -> None:
    generator = torch.Generator().manual_seed(step)
    for _, param in named:
        full = torch.randn(param.shape, generator=generator)
        if isinstance(param, DTensor):
            param.grad = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        else:
            param.grad = full


def _count_steps(rank: int, world_size: int, results: str) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].get_group()
    counts: dict[str, dict[str, list]] = {}
    for name, (optimizer_class, settings, counted) in OPTIMIZERS.items():
        for clip in (False, True):
            model, plain = _model(mesh)
            named = [*model.named_parameters(), ("plain", plain)]
            params = [param for _, param in named]
            optimizer = optimizer_class(
                lc.matrix_param_groups(model) + [{"params": [("plain", plain)]}], **settings
            )
            for step in range(1, max(counted.values()) + 1):
                _gradients(step, named)
                clipping = HostSyncs()
                with HostSyncs() as syncs:
                    # as the strategies after backward
                    synchronise_unsharded([("plain", plain)], dp, optimizer.agreement)
                    if clip:
                        with clipping:
                            clip_grad_norm_(params, 1.0, agreement=optimizer.agreement)
                    if name == "muon" and not clip and step == counted["step"]:
                        files = _files_passed_through(optimizer.step)
                    else:
                        optimizer.step()
                for label, at in counted.items():
                    if step == at:
                        key = f"{name} {label}" + (", clipped" if clip else "")
                        counts[key] = {
                            "step": syncs.where,
                            "clipping": clipping.where,
                            "list indexing": syncs.list_indexing,
                        }
            optimizer.agreement.settle()  # a failure of the last step, which no step follows, raises here
    counts["muon step"]["files"] = files
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, counts)
    if rank == 0:
        Path(results).write_text(json.dumps(gathered))


def _files_passed_through(step) -> list[str]:
    """The package's files (but the counter's own) whose functions ``step()`` calls."""
    files = set()

    def called(frame, event, arg) -> None:
        path = Path(frame.f_code.co_filename)
        if event == "call" and path.is_relative_to(PACKAGE) and "tools" not in path.parts:
            files.add(str(path.relative_to(PACKAGE)))

    sys.setprofile(called)
    try:
        step()
    finally:
        sys.setprofile(None)
    return sorted(files)


def _in_decompositions(where: str) -> bool:
    return where.startswith("lightning_canzona/rules/kronecker.py")


@pytest.fixture(scope="module")
def by_rank(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """What every rank counted and traced (one launch for the tests of this module)."""
    results = tmp_path_factory.mktemp("host_syncs") / "counts.json"
    run_on_ranks(4, _count_steps, str(results))
    return json.loads(results.read_text())


def test_a_step_reads_the_device_at_most_once(by_rank: list[dict]) -> None:
    with HostSyncs() as seen:  # what the counter sees: reads and copies of Python data
        value = torch.ones(())
        torch.tensor([1.0]), torch.as_tensor([1.0]), torch.as_tensor(value)
        value.item(), bool(value), int(value), float(value), value.tolist(), value.cpu(), value.numpy()
    assert [where.rsplit(" ", 1)[1] for where in seen.where] == [
        "(tensor)",
        "(as_tensor)",
        "(item)",
        "(__bool__)",
        "(__int__)",
        "(__float__)",
        "(tolist)",
        "(cpu)",
        "(numpy)",
    ]
    report = [
        f"{key}, rank {rank}: {len(counts[key]['step'])} ({'; '.join(counts[key]['step']) or 'none'})"
        for key in by_rank[0]
        for rank, counts in enumerate(by_rank)
    ]
    print("\n".join(report))
    lines = iter(report)
    for key in by_rank[0]:
        decomposing = False
        for counts in (counts[key] for counts in by_rank):
            line = next(lines)
            decompositions = [where for where in counts["step"] if _in_decompositions(where)]
            decomposing |= bool(decompositions)
            # One read: the agreement on gradients, which clipping makes when it comes first.
            assert len(counts["step"]) - len(decompositions) <= HOST_SYNCS_PER_STEP, line
            assert all("distributed/agreement.py" in where for where in counts["clipping"]), line
            assert not counts["list indexing"], (line, counts["list indexing"])
        # A decomposition step adds one read per decomposition (its finiteness check), none else.
        assert decomposing == ("decomposition" in key), key


def test_a_default_muon_step_passes_through_a_few_files(by_rank: list[dict]) -> None:
    files = [counts["muon step"]["files"] for counts in by_rank]
    print("\n".join(f"rank {rank}: {len(each)} files: {' '.join(each)}" for rank, each in enumerate(files)))
    assert all(len(each) <= STEP_FILES for each in files), files
