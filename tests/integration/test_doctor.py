"""``canzona doctor``: every check passes on this machine's CPU, quietly, and a failing check fails
the command."""

from __future__ import annotations

import pytest
import torch

from lightning_canzona.tools import doctor


def test_doctor_quick_passes_every_check_on_the_cpu(examples) -> None:
    code, output, _ = examples["doctor-quick"]
    lines = output.splitlines()
    # A header, one line per check, the summary: nothing else (no Lightning banner, no warning).
    assert len(lines) == 2 + len(doctor.ENVIRONMENT) + len(doctor.CHECKS), output
    assert lines[0] == "canzona doctor --quick on cpu"
    expected = [("INFO", name) for name in doctor.ENVIRONMENT] + [("PASS", name) for name in doctor.CHECKS]
    for line, (verdict, name) in zip(lines[1:-1], expected):
        assert line.startswith(f"{verdict}  {name}  "), output
    assert lines[-1].startswith("All checks passed in ") and code == 0, output


def test_a_failing_check_fails_the_command(monkeypatch, capsys) -> None:
    def raises(settings: doctor.Settings) -> doctor.Result:
        raise RuntimeError("no such kernel\nsecond line")

    name = "Newton–Schulz standard float32"
    monkeypatch.setitem(doctor.NS_ROUNDING_BOUNDS, torch.float32, 0.0)  # no rounding at all: impossible
    monkeypatch.setattr(doctor, "CHECKS", {name: doctor.CHECKS[name], "raises": raises})
    with pytest.raises(SystemExit) as exit:
        doctor.main(["--quick", "--device", "cpu"])
    assert exit.value.code == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[-3].startswith(f"FAIL  {name}  ") and "(bound 0e+00)" in lines[-3]
    assert lines[-2].startswith("FAIL  raises") and lines[-2].endswith("RuntimeError: no such kernel")
    assert lines[-1].startswith("A check failed in ")
