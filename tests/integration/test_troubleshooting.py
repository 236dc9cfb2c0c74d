"""docs/troubleshooting.md stays true: each entry's message is what its mistake prints today.

Every ``###`` entry of the page (before its last section, Lightning's own messages) shows, in a
``text`` block, the error a mistake raises (``…`` stands for a part that varies: a path, a pid).
Each entry has a trigger here, which makes that mistake as a user would (in this process, or on
two ranks where only ranks can meet it); the page and the triggers must name the same entries.
"""

from __future__ import annotations

import functools
import io
import pickle
import re
from collections.abc import Callable
from contextlib import redirect_stderr
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning import Trainer
from multiprocess import DEVICE, run_on_ranks
from torch import nn

import lightning_canzona as lc
from lightning_canzona.checkpoint import (
    check_compatible,
    check_path_exists,
    check_same_optimizers,
    read_saved,
    record,
    verify,
    write_manifest,
)
from lightning_canzona.checkpoint.reading import safe_load
from lightning_canzona.cli import CanzonaCLI, main
from lightning_canzona.distributed.agreement import GradientAgreement
from lightning_canzona.launcher import refuse_fork_after_cuda
from lightning_canzona.mesh import choose_mesh
from lightning_canzona.models import CausalLanguageModel
from lightning_canzona.optim.binding import bind_optimizer

PAGE = Path(__file__).resolve().parents[2] / "docs" / "troubleshooting.md"
TINY_CONFIG = PAGE.parents[1] / "examples" / "configs" / "tiny.yaml"


def _entries() -> dict[str, str]:
    """Each entry's heading and the message of its ``text`` block (the package's messages: the
    page's last section, Lightning's own, is not the package's to print)."""
    entries = {}
    ours = PAGE.read_text().split("\n## Lightning's own messages\n")[0]
    for section in re.split(r"^### ", ours, flags=re.M)[1:]:
        heading, body = section.split("\n", 1)
        block = re.search(r"```text\n(.*?)\n```", body, re.S)
        assert block, f"the entry {heading!r} shows no message"
        entries[heading.strip()] = block.group(1)
    return entries


def _message(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


class NoPlan(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)


class MissingModule(CausalLanguageModel):
    def tensor_parallel_plan(self) -> dict:
        return {**super().tensor_parallel_plan(), "model.layers.0.mlp.fc9": None}


def _mesh_for_heads() -> None:
    choose_mesh(CausalLanguageModel("tiny"), "auto", 4, 1, 4)


def _unsupported_plan() -> None:
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(
        transformers.Qwen3Config(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        )
    )  # fmt: skip
    model._tp_plan = {**model._tp_plan, "model.norm": "sequence_parallel"}
    holder = nn.Module()
    holder.model = model
    choose_mesh(holder, "auto", 2, 1, 2)


def _forked_after_cuda() -> None:
    with mock.patch("torch.cuda.is_initialized", return_value=True):  # a kernel that used its GPU
        refuse_fork_after_cuda("fork", torch.device("cuda", 0))


def _trainer(**kwargs) -> None:
    Trainer(accelerator="cpu", devices=4, logger=False, **kwargs)


def _other_model(tmp_path: Path) -> None:
    path = tmp_path / "run.ckpt"
    torch.save({"state_dict": {"model.embed_tokens.weight": torch.zeros(512, 128)}}, path)
    check_compatible(path, {"model.embed_tokens.weight": (256, 128)}, strict=True)


def _changed_file(tmp_path: Path) -> None:
    folder = tmp_path / "run.ckpt"
    dcp.save({"state_dict": {"weight": torch.zeros(1024)}}, checkpoint_id=folder)
    write_manifest(folder)
    shard = next(folder.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-16] + bytes(16))
    verify(folder)


def _cut_shard(tmp_path: Path) -> None:
    folder = tmp_path / "run.ckpt"
    dcp.save({"state_dict": {"weight": torch.zeros(1024)}}, checkpoint_id=folder)  # no manifest
    shard = next(folder.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    safe_load({"state_dict": {"weight": torch.ones(1024)}}, folder, no_dist=True)


def _cut_file(tmp_path: Path) -> None:
    path = tmp_path / "run.ckpt"
    torch.save({"state_dict": {"weight": torch.zeros(1024)}}, path)
    path.write_bytes(path.read_bytes()[:2000])
    verify(path)


class _RunsCode:
    def __reduce__(self):
        return (Path.touch, ("/tmp/never-created",))


def _crafted(tmp_path: Path) -> None:
    folder = tmp_path / "downloaded.ckpt"
    folder.mkdir()
    (folder / ".metadata").write_bytes(pickle.dumps(_RunsCode()))
    read_saved(folder)


def _other_optimizer() -> None:
    def weights():
        return [nn.Parameter(torch.zeros(4, 4)), nn.Parameter(torch.zeros(4))]

    saved = record([lc.Muon(weights())])
    check_same_optimizers(saved, [lc.SOAP(weights())], "/checkpoints/last.ckpt")


def _non_finite() -> None:
    weight = nn.Parameter(torch.ones(4, 4))
    optimizer = lc.Muon([("model.layers.0.mlp.up_proj.weight", weight)])
    weight.grad = torch.full((4, 4), float("nan"))
    optimizer.step()


def _failed_on_a_rank(rank: int, world_size: int, messages: dict) -> None:
    try:
        failure = ValueError("shapes do not match") if rank == 1 else None
        agreement = GradientAgreement()
        agreement.raise_on_every_rank(failure, torch.device(DEVICE), "The optimizer step")
        agreement.settle()  # where the next step, a save or the end of training raises it
    except RuntimeError as error:
        if rank == 0:
            Path(messages["path"]).write_text(_message(error))


def _another_rank(tmp_path: Path) -> None:
    path = tmp_path / "message.txt"
    run_on_ranks(2, _failed_on_a_rank, {"path": str(path)}, timeout=30)
    raise RuntimeError(path.read_text().removeprefix("RuntimeError: "))


def _cli_typo() -> None:
    stderr = io.StringIO()
    with redirect_stderr(stderr), pytest.raises(SystemExit):
        CanzonaCLI(
            subclass_mode_model=True,
            subclass_mode_data=True,
            parser_kwargs={"parser_mode": "omegaconf"},
            args=["--config", str(TINY_CONFIG), "--model.init_args.optimizer.init_args.lrr", "0.1"],
            run=False,
        )
    line = next(line for line in stderr.getvalue().splitlines() if "is not accepted" in line)
    raise SystemExit(line.strip())


def _strategy_typo() -> None:
    stderr = io.StringIO()
    with redirect_stderr(stderr), pytest.raises(SystemExit):
        main(["fit", "--config", str(TINY_CONFIG), "--trainer.strategy.tensor_paralel_size", "1"])
    (line,) = [line for line in stderr.getvalue().splitlines() if line.startswith("error:")]
    raise SystemExit(line)


@functools.cache
def _transformers_model() -> nn.Module:
    import transformers

    return transformers.AutoModelForCausalLM.from_config(
        transformers.Qwen3Config(
            vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, head_dim=4,
        )
    )  # fmt: skip


def _saved(path: Path, **state: object) -> Path:
    torch.save(state, path)
    return path


def _export_holds_twice(tmp_path: Path) -> None:
    weights = _transformers_model().state_dict()
    state_dict = {
        f"{who}.{name}": tensor for who in ("student", "teacher") for name, tensor in weights.items()
    }
    lc.export_checkpoint(
        _saved(tmp_path / "last.ckpt", state_dict=state_dict),
        "hf-model",
        "transformers",
        _transformers_model(),
    )


def _bench(*args: str) -> None:
    stderr = io.StringIO()
    with redirect_stderr(stderr), pytest.raises(SystemExit):
        main(["bench", *args])
    raise SystemExit(stderr.getvalue().splitlines()[-1])


#: The mistake behind each entry, by its heading.
TRIGGERS: dict[str, Callable[[Path], None]] = {
    "A tensor-parallel size the model's heads cannot take": lambda _: _mesh_for_heads(),
    "A size that does not divide the devices": lambda _: choose_mesh(None, "auto", 3, 1, 4),
    "Both sizes given, and they do not fill the devices": lambda _: choose_mesh(None, 2, 1, 1, 4),
    "Tensor parallelism for a model without a plan": lambda _: choose_mesh(NoPlan(), "auto", 2, 1, 4),
    "A plan that names modules the model does not have": lambda _: choose_mesh(
        MissingModule("tiny"), "auto", 2, 1, 4
    ),
    "A transformers plan entry with no torch equivalent": lambda _: _unsupported_plan(),
    "A checkpoint path with nothing at it": lambda _: check_path_exists(
        "/checkpoints/last-run.ckpt", "ckpt_path"
    ),
    "A notebook that used the GPU before training": lambda _: _forked_after_cuda(),
    "A benchmark on more GPUs than the machine has": lambda _: _bench(
        "step", "--device", "cuda", "--dp", str(torch.cuda.device_count() + 1), "--tp", "1"
    ),
    "A benchmark over NCCL on CPU ranks": lambda _: _bench("step", "--backend", "nccl"),
    "An unsupported precision": lambda _: _trainer(strategy=lc.CanzonaStrategy(), precision="16-true"),
    "A plan setting out of its range": lambda _: lc.CanzonaStrategy(plan=lc.PlanConfig(policy="greedy")),
    "A plan setting given to the optimizer as a keyword": lambda _: lc.Muon(
        [nn.Parameter(torch.zeros(2, 2))], policy="lpt"
    ),
    "The strategy and the optimizer set different plans": lambda _: bind_optimizer(
        lc.Muon([nn.Parameter(torch.zeros(2, 2))], plan=lc.PlanConfig()),
        nn.Module(),
        lc.PlanConfig(policy="lpt"),
    ),
    "An optimizer keyword that does not exist": lambda _: lc.Muon(
        [nn.Parameter(torch.zeros(2, 2))], lrr=0.02
    ),
    "A hyperparameter out of its range": lambda _: lc.Muon([nn.Parameter(torch.zeros(2, 2))], momentum=1.5),
    "A vector in a matrix group": lambda _: lc.Muon(
        [{"params": [("model.norm.weight", nn.Parameter(torch.ones(8)))], "algorithm": "muon"}]
    ),
    "Row blocks that do not fit": lambda _: lc.Muon(
        lc.matrix_param_groups(nn.Sequential(nn.Linear(8, 22)), row_blocks={"0.weight": (10, 6, 4)})
    ),
    "QK-clip on a model with QK-norm": lambda _: CausalLanguageModel(
        optimizer=functools.partial(lc.Muon, qk_clip=lc.QKClip())
    ),
    "QK-clip without a model": lambda _: lc.Muon(
        [torch.zeros(2, 2, requires_grad=True)], qk_clip=lc.QKClip()
    ).step(),
    "A mistyped setting in a config file": lambda _: _cli_typo(),
    "A misspelt strategy setting": lambda _: _strategy_typo(),
    "A checkpoint of another model": _other_model,
    "A checkpoint of another optimizer": lambda _: _other_optimizer(),
    "A file of a checkpoint that changed": _changed_file,
    "A checkpoint file cut short": _cut_file,
    "A distributed checkpoint file cut short": _cut_shard,
    "A checkpoint that would run code": _crafted,
    "A transformers export without the module": lambda tmp_path: lc.export_checkpoint(
        _saved(tmp_path / "last.ckpt", state_dict={"weight": torch.zeros(2)}), "hf-model", "transformers"
    ),
    "A transformers export of a model that is not one": lambda tmp_path: lc.export_checkpoint(
        _saved(tmp_path / "last.ckpt", state_dict={"weight": torch.zeros(2)}),
        "hf-model",
        "transformers",
        CausalLanguageModel("tiny"),
    ),
    "A transformers model that the checkpoint does not hold": lambda tmp_path: lc.export_checkpoint(
        _saved(tmp_path / "last.ckpt", state_dict={"weight": torch.zeros(2)}),
        "hf-model",
        "transformers",
        _transformers_model(),
    ),
    "A transformers model held twice": _export_holds_twice,
    "A model key that the checkpoint does not have": lambda tmp_path: lc.export_checkpoint(
        _saved(tmp_path / "checkpoint", model={"weight": torch.zeros(2)}),
        "model.safetensors",
        model_key="state_dict",
    ),
    "A checkpoint with several models": lambda tmp_path: lc.export_checkpoint(
        _saved(tmp_path / "distilled.ckpt", student={"w": torch.zeros(2)}, teacher={"w": torch.zeros(2)}),
        "model.safetensors",
    ),
    "A checkpoint with no model": lambda tmp_path: lc.export_checkpoint(
        _saved(
            tmp_path / "optimizer.ckpt",
            optimizer=torch.optim.SGD([nn.Parameter(torch.zeros(2))]).state_dict(),
        ),
        "model.safetensors",
    ),
    "A NaN or Inf gradient": lambda _: _non_finite(),
    "A failure on another rank": _another_rank,
}


def test_every_entry_has_a_trigger_and_every_trigger_an_entry() -> None:
    assert list(_entries()) == list(TRIGGERS)


@pytest.mark.parametrize("heading", list(TRIGGERS))
def test_each_entry_shows_the_message_its_mistake_prints(heading, tmp_path) -> None:
    with pytest.raises(BaseException) as caught:  # noqa: B017 (each trigger raises its own)
        TRIGGERS[heading](tmp_path)
    error = caught.value
    printed = str(error) if isinstance(error, SystemExit) else _message(error)
    documented = _entries()[heading]
    pattern = ".*?".join(re.escape(part) for part in documented.split("…"))
    assert re.fullmatch(pattern, printed, re.S), f"{heading}:\n{printed}"
