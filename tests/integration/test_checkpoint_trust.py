"""Checkpoints that are never lost, never silently wrong, never a way in.

A swap killed at each of its steps leaves one complete checkpoint under its name; bytes flipped in
a file are found before anything loads; any damage to any file, through every door, is one error
naming the file on every rank (a fuzz test); another optimizer's state is refused, or left out
when asked; a crafted checkpoint runs none of its code.
"""

from __future__ import annotations

import functools
import json
import pickle
import shutil
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning import Callback
from multiprocess import run_on_ranks
from test_checkpoints import _fit, _RunsCode
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import lightning_canzona as lc
from lightning_canzona.checkpoint import (
    CorruptCheckpointError,
    check_before_loading,
    check_path_exists,
    integrity,
    load_distributed,
    load_single_file,
    read_saved,
    recover,
    replace_with,
    staging_path,
    swap,
)
from lightning_canzona.checkpoint.integrity import MANIFEST, _entry
from lightning_canzona.checkpoint.reading import MODEL_KEY, safe_load
from lightning_canzona.checkpoint.swap import previous_path
from lightning_canzona.cli import CanzonaCLI
from lightning_canzona.composition import compose
from lightning_canzona.models import CausalLanguageModel

MUON = functools.partial(lc.Muon, lr=0.02, adamw_lr=3e-3)
SOAP = functools.partial(lc.SOAP, lr=3e-3, precondition_frequency=2)
STEP_3 = Path("checkpoints") / "epoch=0-step=3.ckpt"
TINY_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "configs" / "tiny.yaml"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """A Muon run's checkpoint at step 3, in each format (2 ranks, data-parallel)."""
    paths = {}
    for form, distributed in (("distributed", True), ("single-file", False)):
        directory = tmp_path_factory.mktemp(form)
        _fit(directory, "saved", distributed=distributed, mesh=(2, 1), optimizer=MUON)
        paths[form] = directory / STEP_3
    return paths


def _copy(source: Path, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / "copy.ckpt"
    (shutil.copytree if source.is_dir() else shutil.copy)(source, target)
    return target


def _flip(path: Path, count: int = 16) -> None:
    """Change ``count`` bytes in the middle of a file, as a bad disk or transfer would."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + count] = bytes(b ^ 0xFF for b in data[middle : middle + count])
    path.write_bytes(bytes(data))


# -- The swap ------------------------------------------------------------------------------------


def _folder(path: Path, version: str) -> None:
    path.mkdir()
    for name in ("__0_0.distcp", ".metadata", "meta.pt"):
        (path / name).write_text(f"{version}:{name}")


def _holds(path: Path) -> str:
    """Which complete checkpoint ``path`` holds."""
    versions = {(path / name).read_text().split(":")[0] for name in ("__0_0.distcp", ".metadata", "meta.pt")}
    assert len(versions) == 1, versions
    return versions.pop()


class Killed(BaseException):
    """The process died here: nothing after this step ran."""


class Dies:
    """Wraps the swap's steps; the process dies before step ``after`` + 1."""

    def __init__(self, after: int) -> None:
        self.after, self.done = after, 0

    def step(self, function, *args):
        if self.done == self.after:
            raise Killed
        self.done += 1
        return function(*args)


@pytest.mark.parametrize("atomic_exchange", [True, False], ids=["exchange", "two-renames"])
def test_a_swap_killed_at_any_step_leaves_one_complete_checkpoint_under_its_name(
    tmp_path, atomic_exchange
) -> None:
    # The steps: exchange, delete the old; or delete a stale .old, move the old aside, move the
    # new in, delete the old.
    steps = 2 if atomic_exchange else 4
    outcomes = []
    for after in range(steps + 1):
        path = tmp_path / str(after) / "last.ckpt"
        path.parent.mkdir()
        _folder(path, "old")
        _folder(staging_path(path), "new")
        dies = Dies(after)
        exchange = functools.partial(dies.step, swap.exchange) if atomic_exchange else lambda *_: False
        with (
            mock.patch.object(swap.os, "replace", functools.partial(dies.step, swap.os.replace)),
            mock.patch.object(swap, "remove", functools.partial(dies.step, swap.remove)),
            mock.patch.object(swap, "exchange", exchange),
        ):
            try:
                replace_with(staging_path(path), path)
            except Killed:
                pass
        if atomic_exchange:  # the name holds a checkpoint at every step, without recovery
            assert _holds(path) in ("old", "new")
        check_path_exists(path, "ckpt_path")  # puts back what a kill between two renames left
        outcomes.append(_holds(path))
        assert not previous_path(path).exists()
    # Before the swap moved the new checkpoint in, the old one; after, the new one.
    moved_in = 1 if atomic_exchange else 3
    assert outcomes == ["old"] * moved_in + ["new"] * (steps + 1 - moved_in)


def test_a_checkpoint_left_beside_its_name_is_recovered_when_a_run_resumes(saved, tmp_path, caplog) -> None:
    path = _copy(saved["distributed"], tmp_path)
    # Killed between the two renames of a swap without an atomic exchange: the name is empty.
    path.rename(previous_path(path))
    shutil.copytree(previous_path(path), staging_path(path))
    losses = _fit(tmp_path, "resumed", ckpt_path=str(path), mesh=(2, 1), optimizer=MUON)
    assert len(losses) == 3 and path.is_dir() and not previous_path(path).exists()
    assert not staging_path(path).exists()
    assert any("recovered the checkpoint" in message for message in caplog.messages)
    assert not recover(path)  # nothing left to recover


# -- Integrity -----------------------------------------------------------------------------------


class ManifestFailsOnRankZero(Callback):
    """Saves at step 2; at step 4 saves again, and rank 0 cannot write the manifest. A rank whose
    save raises leaves what it raised."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == 2:
            trainer.save_checkpoint(self.path)
        elif trainer.global_step == 4:
            if trainer.global_rank == 0:
                integrity.json.dumps = mock.Mock(side_effect=OSError("disk full (injected)"))
            try:
                trainer.save_checkpoint(self.path)
            except Exception as error:
                (self.path.parent / f"raised-{trainer.global_rank}").write_text(str(error))
                raise


def test_a_manifest_that_rank_zero_cannot_write_fails_the_save_on_every_rank(tmp_path) -> None:
    path = tmp_path / "latest.ckpt"
    failing = ManifestFailsOnRankZero(path)
    with pytest.raises(Exception, match="disk full|still holds the previous checkpoint"):
        _fit(tmp_path, "failed", mesh=(2, 1), optimizer=MUON, checkpoints=False, extra=[failing])
    # The rank that wrote no manifest learnt of the failure from the save, not from a peer gone.
    assert "still holds the previous checkpoint" in (tmp_path / "raised-1").read_text()
    assert torch.load(path / "meta.pt", weights_only=False)["global_step"] == 2  # the previous one
    assert not staging_path(path).exists()


@pytest.mark.parametrize(
    "form, damaged, message",
    [
        ("distributed", "__1_0.distcp", r"__1_0\.distcp has CRC-32 [0-9a-f]{8}, [0-9a-f]{8} when saved"),
        (
            "single-file",
            None,
            r"the record archive/data/\d+ of copy\.ckpt has another CRC-32 than when saved",
        ),
    ],
    ids=["distributed-shard", "single-file"],
)
def test_flipped_bytes_are_an_error_on_every_rank_before_anything_loads(
    saved, tmp_path, form, damaged, message
) -> None:
    path = _copy(saved[form], tmp_path)
    _flip(path / damaged if damaged else path)
    with pytest.raises(Exception, match=rf"The checkpoint {path} is corrupt or incomplete: {message}"):
        _fit(tmp_path, "resumed", ckpt_path=str(path), mesh=(2, 1), optimizer=MUON)
    # Asked explicitly, it loads unchecked.
    assert lc.CanzonaStrategy(verify_checkpoints=False).verify_checkpoints is False


def test_damage_is_named_by_a_reader_that_does_not_verify_and_by_fabric_load_raw(saved, tmp_path) -> None:
    # Each file damaged in every way, on two ranks, through the loaders: the fuzz test below.
    folder = _copy(saved["distributed"], tmp_path)
    _flip(folder / ".metadata")
    # Read unverified, the damage is still named, not an UnpicklingError from deep inside torch.
    with pytest.raises(
        CorruptCheckpointError,
        match=rf"The checkpoint {folder} is corrupt or incomplete: its \.metadata cannot be read",
    ):
        read_saved(folder)
    single = tmp_path / "cut.ckpt"
    single.write_bytes(saved["single-file"].read_bytes()[: saved["single-file"].stat().st_size // 2])
    # fabric.load_raw(path, module): a bare state dict's file, verified too.
    with pytest.raises(CorruptCheckpointError, match=r"cut\.ckpt is not a whole zip archive"):
        lc.CanzonaFabricStrategy().load_checkpoint(single, nn.Linear(2, 2))
    manifest = json.loads((saved["distributed"] / MANIFEST).read_text())["files"]
    assert set(manifest) == {".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"}


# -- Any damage, through the loaders -------------------------------------------------------------


@dataclass(frozen=True)
class Damage:
    """One way to damage one file of a checkpoint (``name``: in its folder; ``""``: the file)."""

    name: str
    operation: str  # "flip" or "zero" 8 bytes at the offset, "truncate" there, or "delete"
    offset: int = 0

    def file(self, checkpoint: Path) -> Path:
        return checkpoint / self.name if self.name else checkpoint

    def of(self, data: bytes) -> bytes | None:
        """The file's bytes after the damage (``None``: deleted)."""
        if self.operation == "delete":
            return None
        damaged, part = bytearray(data), slice(self.offset, self.offset + 8)
        if self.operation == "truncate":
            del damaged[self.offset :]
        elif self.operation == "flip":
            damaged[part] = bytes(b ^ 0xFF for b in damaged[part])
        else:
            damaged[part] = bytes(len(damaged[part]))
        return bytes(damaged)


def _offsets(size: int) -> set[int]:
    """Where to damage a file: its first bytes (a zip's first local header and the name in it, a
    pickle's protocol, JSON's opening brace), its quarters, and its last bytes (a zip's central
    directory and end record, a pickle's STOP)."""
    offsets = (0, 1, 30, size // 4, size // 2, 3 * size // 4, size - 100, size - 22, size - 1)
    return {offset for offset in offsets if 0 <= offset < size}


def _damages(path: Path, operations: tuple[str, ...], offsets=_offsets) -> list[Damage]:
    """Each of ``operations`` at each of ``offsets`` of every file of the checkpoint at ``path``
    that changes it (zeros written over zeros do not)."""
    damages = []
    for file in sorted(path.iterdir()) if path.is_dir() else [path]:
        data = file.read_bytes()
        for operation in operations:
            for offset in [0] if operation == "delete" else sorted(offsets(len(data))):
                damage = Damage(file.name if path.is_dir() else "", operation, offset)
                if damage.of(data) != data:
                    damages.append(damage)
    return damages


def _load_each_damaged_copy(rank: int, world_size: int, checkpoints: list, report: str) -> None:
    """Load each checkpoint as the strategies do, then under each of its damages (rank 0 damages a
    file, then puts it back), checked or not (``checkpoints``: each path with pairs of
    ``verify_files`` and damages; unchecked, a folder without its manifest). Each load must give
    the saved weights or the package's error naming the file, on every rank, in seconds. Rank 0
    writes each outcome's count and every other outcome to ``report``."""
    mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    module = CausalLanguageModel("tiny")
    compose(module, mesh)

    def load(path: Path, verify: bool) -> None:
        # A new optimizer each time: one that loaded a state once has more param-group keys.
        optimizer = MUON(lc.matrix_param_groups(module.model))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*has no manifest")
            check_before_loading(path, module, [optimizer], strict=True, verify_files=verify)
            if path.is_dir():
                load_distributed(path, module, {"optimizer_0": optimizer})
            else:
                load_single_file(path, module, MODEL_KEY, {})

    def weights() -> dict[str, torch.Tensor]:  # this rank's shards: no collective
        state = module.state_dict()
        return {name: t.to_local() if isinstance(t, DTensor) else t for name, t in state.items()}

    counts, problems = {"loaded": 0, "corrupt": 0}, []
    for path, phases in checkpoints:
        path = Path(path)
        load(path, verify=True)
        saved = {name: tensor.clone() for name, tensor in weights().items()}
        for verify, damages in phases:
            if rank == 0 and not verify and path.is_dir():
                (path / MANIFEST).unlink()
            for damage in damages:
                file = damage.file(path)
                if rank == 0:
                    original = file.read_bytes()
                    damaged = damage.of(original)
                    file.unlink() if damaged is None else file.write_bytes(damaged)
                dist.barrier()
                with torch.no_grad():
                    for parameter in module.parameters():
                        parameter.add_(1.0)  # a load that succeeds must put the saved weights back
                start = time.monotonic()
                try:
                    load(path, verify)
                    same = all(torch.equal(tensor, saved[name]) for name, tensor in weights().items())
                    outcome = "loaded" if same else "loaded other weights"
                except CorruptCheckpointError as error:
                    checkpoint, _, listed = str(error).partition(" is corrupt or incomplete: ")
                    named = checkpoint == f"The checkpoint {path}" and file.name in listed
                    outcome = "corrupt" if named else f"the file not named: {error}"
                except Exception as error:
                    outcome = f"{type(error).__name__}: {error}"
                outcomes: list = [None] * world_size
                dist.all_gather_object(outcomes, (outcome, time.monotonic() - start))
                if rank == 0:
                    kinds = {outcome for outcome, _ in outcomes}
                    if len(kinds) > 1 or not kinds <= set(counts) or max(s for _, s in outcomes) > 10:
                        problems.append(f"{damage} (verify_files={verify}): {outcomes}")
                    else:
                        counts[kinds.pop()] += 1
                    file.write_bytes(original)
                dist.barrier()
    if rank == 0:
        Path(report).write_text(json.dumps({"counts": counts, "problems": problems}, indent=1))


def test_any_damage_loads_the_saved_weights_or_is_one_named_error_on_every_rank(saved, tmp_path) -> None:
    checkpoints, cases = [], 0
    for form in ("distributed", "single-file"):
        path = _copy(saved[form], tmp_path / form)
        checked = _damages(path, ("flip", "zero", "truncate", "delete"))
        # Unchecked (a folder without a manifest, as an earlier version saved; verify_files=False):
        # a file missing or cut short is still the error, never torch's or DCP's. Any cut is one
        # case of the same check: at its start, middle and last byte.
        ends = _damages(path, ("truncate", "delete"), offsets=lambda size: {0, size // 2, size - 1})
        unchecked = [damage for damage in ends if damage.name != MANIFEST]
        checkpoints.append((str(path), [(True, checked), (False, unchecked)]))
        cases += len(checked) + len(unchecked)
    report = tmp_path / "report.json"
    run_on_ranks(2, _load_each_damaged_copy, checkpoints, str(report), timeout=30)
    outcome = json.loads(report.read_text())
    assert outcome["problems"] == []
    # Nearly every case is the error. The folder without its manifest loads unverified, and so
    # does a file whose damage is in bytes no reader uses (the high byte of the zip comment's
    # length, at the end of the single file): the saved weights, as asserted on the ranks.
    assert sum(outcome["counts"].values()) == cases
    assert outcome["counts"]["loaded"] >= 1 and outcome["counts"]["corrupt"] > 0.95 * cases


def _cli_refuses(path: Path, *arguments: str) -> str:
    """The message of ``canzona fit --ckpt_path path`` (in this process), which must stop on it."""
    with pytest.raises(CorruptCheckpointError) as refused:
        CanzonaCLI(
            subclass_mode_model=True,
            subclass_mode_data=True,
            parser_kwargs={"parser_mode": "omegaconf"},
            args=["fit", "--config", str(TINY_CONFIG), "--ckpt_path", str(path), *arguments],
        )
    return str(refused.value)


def test_canzona_fit_refuses_a_damaged_ckpt_path_before_any_rank_starts(
    examples, saved, tmp_path, monkeypatch
) -> None:
    # LightningCLI reads a single file's hyperparameters in the launching process: before it,
    # the file is checked there, and its damage is the package's error, once.
    code, printed, _ = examples["cli-damaged-ckpt"]
    assert code == 1 and printed.count("Traceback") == 1, printed[-3000:]
    assert "Initializing distributed" not in printed  # no rank started
    assert (
        "CorruptCheckpointError: The checkpoint cut.ckpt is corrupt or incomplete: cut.ckpt is not a "
        "whole zip archive, as torch saves one (File is not a zip file). Load another checkpoint."
    ) in printed
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(saved["single-file"].read_bytes()[:-5000])  # a saved checkpoint's, cut alike
    # The same door with other damage, and with verify_checkpoints=False (the read still checked).
    monkeypatch.setattr(sys, "argv", ["canzona"])  # LightningCLI warns of arguments given twice
    start = tmp_path / "start.ckpt"
    # The first record's name: torch reads on, Python's zipfile does not.
    start.write_bytes(Damage("", "flip", 30).of(saved["single-file"].read_bytes()))
    refused = _cli_refuses(start)
    assert "start.ckpt is not a whole zip archive, as torch saves one (UnicodeDecodeError" in refused
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(bytes(range(256)) * 16)
    unchecked = ("--trainer.strategy", "lightning_canzona.CanzonaStrategy")
    unchecked += ("--trainer.strategy.verify_checkpoints", "false")
    for path in (garbage, cut):
        assert f"{path.name} is not a whole zip archive" in _cli_refuses(path, *unchecked)


# -- The optimizer -------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["distributed", "single-file"])
def test_another_optimizers_state_is_refused_or_left_out_when_asked(saved, tmp_path, form) -> None:
    resume = functools.partial(
        _fit, tmp_path, "soap", ckpt_path=str(saved[form]), distributed=form == "distributed", mesh=(2, 1)
    )
    with pytest.raises(
        Exception,
        match=r"holds the state of lightning_canzona\.Muon \[param groups: muon \(momentum_buffer\), adamw "
        r"\(exp_avg, exp_avg_sq, step\)\], but this run's optimizer is lightning_canzona\.SOAP \[param "
        r"groups: soap \(.*\)\].*CanzonaStrategy\(load_optimizer_state=False\)",
    ):
        resume(optimizer=SOAP)
    losses = resume(optimizer=SOAP, load_optimizer_state=False)
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))  # from step 3, SOAP afresh


# -- Nothing in a checkpoint runs ----------------------------------------------------------------


def test_a_crafted_metadata_runs_nothing(saved, tmp_path) -> None:
    folder, marker = _copy(saved["distributed"], tmp_path), tmp_path / "code-ran"
    (folder / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    # A consistent manifest: the file is what its author meant, not damaged.
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["files"][".metadata"] = _entry(folder / ".metadata")
    (folder / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(Exception, match=r"was refused: its \.metadata refers to pathlib\.Path\.touch"):
        _fit(tmp_path, "crafted", ckpt_path=str(folder), mesh=(2, 1), optimizer=MUON)
    assert not marker.exists()


def test_a_crafted_value_inside_a_distributed_checkpoint_runs_nothing(tmp_path) -> None:
    folder, marker = tmp_path / "crafted", tmp_path / "code-ran"
    dcp.save({"weight": torch.zeros(2), "lr": _RunsCode(marker)}, checkpoint_id=folder)
    loaded = {"weight": torch.ones(2), "lr": 0.1}
    with pytest.raises(ValueError, match=r"A value of the checkpoint \(lr\) was refused"):
        safe_load(loaded, folder)
    assert not marker.exists()
    dcp.load(loaded, checkpoint_id=folder)  # torch's own planner runs it: the hole closed above
    assert marker.exists()
