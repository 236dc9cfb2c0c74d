"""``canzona bench``: the end-to-end training benchmark runs on a tiny setting."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_canzona.cli import main


def test_bench_train_runs_every_variant_and_writes_json_and_chart(tmp_path, capsys) -> None:
    json_path, chart = tmp_path / "bench.json", tmp_path / "bench.png"
    quick = ["--dp", "1", "--tp", "2", "--steps", "2", "--warmup", "0"]
    main(["bench", "train", *quick, "--json", str(json_path), "--out", str(chart)])
    record = json.loads(json_path.read_text())
    results = {r["name"]: r for r in record["results"]}
    assert list(results) == ["AdamW", "torch.optim.Muon", "canzona", "canzona (Fabric)"]
    for result in results.values():
        assert result["iteration_ms"] > result["optimizer_ms"] > 0
    canzona, torch_muon = results["canzona"], results["torch.optim.Muon"]
    fabric = results["canzona (Fabric)"]
    assert list(record["ratios"]) == [
        "canzona / AdamW",
        "canzona / torch.optim.Muon",
        "canzona (Fabric) / canzona",
    ]
    assert record["ratios"]["canzona / torch.optim.Muon"] == pytest.approx(
        canzona["iteration_ms"] / torch_muon["iteration_ms"]
    )
    assert record["ratios"]["canzona (Fabric) / canzona"] == pytest.approx(
        fabric["iteration_ms"] / canzona["iteration_ms"]
    )
    # The same weights, data and Muon settings: both Muons train alike (bf16 Newton–Schulz).
    assert canzona["final_loss"] == pytest.approx(torch_muon["final_loss"], abs=0.02)
    # The same module, optimizer, batches per rank and mesh: the same computation, in the same
    # order, so the losses are bitwise equal (observed); the tolerance only forgives a change in
    # the order of a collective's sums, not a different batch or optimizer.
    assert fabric["final_loss"] == pytest.approx(canzona["final_loss"], abs=1e-5)
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "canzona / torch.optim.Muon" in printed
    assert "canzona (Fabric) / canzona" in printed


def test_bench_ns_compares_the_forms_on_time_and_accuracy(capsys) -> None:
    main(["bench", "ns", "--shapes", "32x96", "--dtypes", "float32", "--repeats", "1"])
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[2]: line.split() for line in lines[2:]}
    assert set(rows) == {"standard", "gram", "standard-symmetric", "gram-symmetric"}
    for form, row in rows.items():
        # Rounding alone is float32's; the quintic schedule leaves the polar factor ~15 % away.
        assert float(row[-1]) < 1e-5, form
        assert 0.05 < float(row[-2]) < 0.5, form


def test_bench_step_times_every_variant_and_a_team_computes_the_large_matrix(capsys) -> None:
    # The Gram form on `wide` (one 16384 × 256 projection, 94 % of Muon's FLOPs), on 2 ranks.
    # One step, untimed none, in float32 (bf16 matmuls take 40× float32's time on a CPU without
    # bf16 instructions): what is asserted is the table and the plan.
    quick = ["--dp", "2", "--tp", "1", "--steps", "1", "--warmup", "0", "--compute-dtype", "float32"]
    main(["bench", "step", "--presets", "wide", "--optimizer", "muon-gram", *quick])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "preset wide, muon-gram: optimizer step, median over ranks' slowest"
    rows = {line[:26].strip(): line[26:].split() for line in lines[2:] if not line.startswith("canzona")}
    assert list(rows) == [
        "sync",
        "round_robin",
        "lpt (no overlap)",
        "canzona (whole matrices)",
        "canzona",
        "canzona (teams, measured)",
    ]  # no torch.optim.Muon: it has the standard form only
    assert rows["canzona"][1] == "1.00" and all(float(row[0]) > 0 for row in rows.values())
    # Muon's momentum alone is half of AdamW's two moments; the step's buffers come on top, counted
    # by the allocator (6) and by the plan's model (7: sync's and the policies' alike).
    assert all(float(row[9]) >= 0.5 and float(row[6]) > 0 and float(row[7]) > 0 for row in rows.values()), (
        rows
    )
    # Whole, the large matrix's owner plans 1.58 × the mean of 2 ranks (whether a team pays at
    # the prices measured on this machine is the machine's to say).
    assert rows["canzona (whole matrices)"][5] == "1.58"


def test_bench_train_on_gpus_says_before_any_rank_starts_what_the_machine_lacks(capsys) -> None:
    # `bench step`'s are test_troubleshooting's (its entries for benchmarks).
    ranks = torch.cuda.device_count() + 1  # one GPU more than there are
    with pytest.raises(SystemExit):
        main(["bench", "train", "--device", "cuda", "--dp", str(ranks), "--tp", "1"])
    expected = f"--device cuda runs {ranks} ranks, one GPU each, and {ranks - 1} GPUs are visible"
    assert expected in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "train", "--backend", "nccl"])
    assert "--backend nccl needs --device cuda" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "step", "--dp", "4", "--replicate", "3"])
    assert "--replicate 3 does not divide --dp 4" in capsys.readouterr().err


def test_bench_qk_clip_times_the_iteration_with_and_without_it(capsys) -> None:
    main(["bench", "qk-clip", "--presets", "tiny", "--seq-lens", "16", "--batch-size", "1", "--repeats", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == [
        "preset",
        "seq",
        "batch",
        "iteration",
        "ms",
        "+",
        "QK-clip",
        "ms",
        "ratio",
        "clip",
        "ms",
    ]
    preset, seq, batch, plain, clipped, ratio, clip = lines[2].split()
    assert (preset, seq, batch) == ("tiny", "16", "1")
    assert float(ratio) == pytest.approx(float(clipped) / float(plain), rel=0.01)  # ms rounded
    assert 0 < float(clip) < float(plain)
