"""Checkpoints that are never lost, never silently wrong, never a way in.

A swap killed at each of its steps leaves one complete checkpoint under its name; bytes flipped in
a file are found before anything loads; another optimizer's state is refused, or left out when
asked; a crafted checkpoint runs none of its code.
"""

from __future__ import annotations

import functools
import json
import pickle
import shutil
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning import Callback
from multiprocess import run_on_ranks
from test_checkpoints import _fit, _RunsCode

import lightning_canzona as lc
from lightning_canzona.checkpoint import (
    check_path_exists,
    integrity,
    read_saved,
    recover,
    replace_with,
    staging_path,
    swap,
)
from lightning_canzona.checkpoint.integrity import MANIFEST, _entry, problems
from lightning_canzona.checkpoint.reading import safe_load
from lightning_canzona.checkpoint.swap import previous_path

MUON = functools.partial(lc.Muon, lr=0.02, adamw_lr=3e-3)
SOAP = functools.partial(lc.SOAP, lr=3e-3, precondition_frequency=2)
STEP_3 = Path("checkpoints") / "epoch=0-step=3.ckpt"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """A Muon run's checkpoint at step 3, in each format (2 ranks, data-parallel)."""
    paths = {}
    for form, distributed in (("distributed", True), ("single-file", False)):
        directory = tmp_path_factory.mktemp(form)
        _fit(directory, "saved", distributed=distributed, mesh=(2, 1), optimizer=MUON)
        paths[form] = directory / STEP_3
    return paths


def _copy(source: Path, tmp_path: Path) -> Path:
    target = tmp_path / "copy.ckpt"
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


def _every_rank_finds(rank: int, world_size: int, path: str, expected: str) -> None:
    found = problems(Path(path))
    assert found and expected in found[0], found


def test_damaged_metadata_and_a_cut_file_are_named(saved, tmp_path) -> None:
    folder = _copy(saved["distributed"], tmp_path)
    _flip(folder / ".metadata")
    run_on_ranks(2, _every_rank_finds, str(folder), ".metadata has CRC-32", timeout=30)
    # Unverified, the damage is still named, not an UnpicklingError from deep inside torch.
    with pytest.raises(
        ValueError, match=rf"The checkpoint {folder} is corrupt or incomplete: its \.metadata cannot be read"
    ):
        read_saved(folder)
    single = tmp_path / "cut.ckpt"
    single.write_bytes(saved["single-file"].read_bytes()[: saved["single-file"].stat().st_size // 2])
    run_on_ranks(2, _every_rank_finds, str(single), "cut.ckpt is not a whole zip archive", timeout=30)
    manifest = json.loads((saved["distributed"] / MANIFEST).read_text())["files"]
    assert set(manifest) == {".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"}


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
