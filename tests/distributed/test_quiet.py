"""A correct run is quiet: the third-party warnings that `lightning_canzona.warning_filters` filters
are harmless where they are filtered, and nothing else of theirs is hidden."""

from __future__ import annotations

import contextlib
import copy
import logging
import warnings
from collections.abc import Iterator

import torch
from multiprocess import DEVICE, run_on_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from lightning_canzona.composition import compose
from lightning_canzona.warning_filters import ignore_harmless_warnings

VIEW_WARNING = "returned a view tensor"


@contextlib.contextmanager
def _warnings_as_in_a_run() -> Iterator[list[warnings.WarningMessage]]:
    """Record every warning that the package's filters let through (pytest's own filters, which
    show every deprecation warning first, set aside)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        ignore_harmless_warnings()
        warnings.filterwarnings("always", append=True)
        yield caught


class Holder(nn.Module):
    """Holds a transformers model as a LightningModule does."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


def test_lightnings_pytree_deprecation_is_filtered_and_its_flattening_unchanged() -> None:
    from lightning.pytorch.utilities._pytree import _map_and_unflatten, _tree_flatten

    batch = {"tokens": torch.arange(6).view(2, 3), "meta": [1, 2], "pair": (torch.ones(2), "a")}
    with _warnings_as_in_a_run() as caught:
        leaves, spec = _tree_flatten(batch)
        rebuilt = _map_and_unflatten(lambda leaf: leaf, leaves, spec)
    assert not [w for w in caught if "LeafSpec" in str(w.message)]
    assert rebuilt.keys() == batch.keys() and torch.equal(rebuilt["tokens"], batch["tokens"])
    assert rebuilt["meta"] == [1, 2] and rebuilt["pair"][1] == "a"
    # Another deprecation in the same module is not hidden.
    with _warnings_as_in_a_run() as caught:
        warnings.warn_explicit(
            "something else is deprecated",
            FutureWarning,
            "_pytree.py",
            1,
            "lightning.pytorch.utilities._pytree",
        )
    assert len(caught) == 1


def _root_view_is_harmless(rank: int, world_size: int) -> None:
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(DEVICE)
    reference = copy.deepcopy(model)
    mesh = init_device_mesh(DEVICE, (1, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    compose(Holder(model), mesh)  # TP plan, then FSDP2: the transformers model is the one root unit
    batch = torch.randint(64, (2, 16), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with warnings.catch_warnings(record=True) as caught:
        warnings.filterwarnings("always", append=True)  # after the filter that compose added
        output = model(input_ids=batch, labels=batch)
    # The root returned a view (the head's gathered logits: DTensor.to_local), which FSDP2 warns
    # about; filtered for this root only.
    assert output.logits._base is not None
    assert not [w for w in caught if VIEW_WARNING in str(w.message)]
    output.loss.backward()
    expected = reference(input_ids=batch, labels=batch)
    expected.loss.backward()
    torch.testing.assert_close(output.loss, expected.loss, rtol=1e-5, atol=1e-6)
    gradients = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        torch.testing.assert_close(grad, gradients[name].grad, rtol=1e-4, atol=1e-6, msg=name)
    # The filter names the root's class: the same warning about another unit still shows.
    with warnings.catch_warnings(record=True) as caught:
        warnings.filterwarnings("always", append=True)
        warnings.warn_explicit(
            "FSDP2-wrapped module (FSDPQwen3DecoderLayer) returned a view tensor. …",
            UserWarning,
            "_fsdp_state.py",
            1,
            "torch.distributed.fsdp._fully_shard._fsdp_state",
        )
    assert len(caught) == 1


def test_fsdp2_view_warning_of_a_tensor_parallel_root_is_filtered_and_its_gradients_exact() -> None:
    run_on_ranks(2, _root_view_is_harmless)


def test_dtensors_note_on_sequential_gathers_and_norms_is_dropped_and_on_sums_kept() -> None:
    # What the note is about is harmless for a gather: test_weights_back gathers weights sharded over
    # both mesh dimensions and finds them equal bit for bit to DTensor's own full_tensor().
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append
    handler.filters = logger.filters  # the package's filter, as the logger applies it
    note = "While redistributing from %s to %s, %d sequential %s operations will be performed. %s"
    cases = [
        ("(S, S)", "all_gather"),
        ("(S, S)", "reduce_scatter"),
        ("(_NormPartial(2.0), _NormPartial(2.0))", "all_reduce"),  # a gradient norm (clipping)
        ("(Partial(sum), Partial(sum))", "all_reduce"),
    ]
    for source, collective in cases:
        record = logger.makeRecord(
            logger.name, logging.WARNING, __file__, 1, note, (source, "(R, R)", 2, collective, ""), None
        )
        handler.handle(record)
    assert [(record.args[0], record.args[3]) for record in seen] == [cases[1], cases[3]]
