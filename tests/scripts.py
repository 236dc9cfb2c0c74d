"""Run a user's script as a user would, and never leave a process of it behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path


def run_script(*arguments: object, cwd: Path, timeout: float = 300) -> tuple[int, str]:
    """Run ``python arguments…`` (a script and its arguments, or ``-m`` and a module) in a process
    session of its own; return its exit code and everything it printed. The session (the ranks it
    started included) is killed at the end, whatever happened: on a timeout, the test fails with
    what was printed so far."""
    process = subprocess.Popen(
        [sys.executable, *map(str, arguments)],
        cwd=cwd,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        raise AssertionError(f"python {arguments} ran past {timeout} s:\n{output[-3000:]}") from None
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return process.returncode, output


#: The entry of `run_examples_forked`'s results that says what importing the package loaded.
IMPORTED = "import lightning_canzona"
#: Runs each ``[folder, [script, arguments…]]`` of the JSON list ``sys.argv[1]`` in turn, in that
#: folder, every `CanzonaStrategy` and ``strategy="canzona"`` it builds forking its ranks
#: from this one interpreter; prints `_BEGIN` before each run's output and `_END` with its exit
#: code after it. First, `_LOADED` and every module loaded once the package is imported.
_BEGIN, _END, _LOADED = "=== example begins: ", "=== example exit code: ", "=== loaded: "
_FORKED = f"""
import functools, json, os, runpy, sys, traceback
import lightning_canzona as lc
print({_LOADED!r} + " ".join(sorted(sys.modules)), flush=True)
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry
lc.CanzonaStrategy = functools.partial(lc.CanzonaStrategy, start_method="fork")
for registry in (StrategyRegistry, STRATEGY_REGISTRY):
    registry["canzona"] = registry["canzona_notebook"]
for folder, sys.argv in json.loads(sys.argv[1]):
    os.chdir(folder)
    print({_BEGIN!r} + sys.argv[0], flush=True)
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
        code = 0
    except SystemExit as exit:
        code = 0 if exit.code is None else exit.code if isinstance(exit.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    print({_END!r} + str(code), flush=True)
"""


def run_examples_forked(runs: dict[str, tuple[Path, Path, list[object]]]) -> dict[str, tuple[int, str]]:
    """The exit code and output of each example in ``runs`` (by name: the script, the folder it
    runs in, its arguments), all run one after the other in one interpreter, each `CanzonaStrategy`
    or ``strategy="canzona"`` forking its ranks instead of re-running the script once each: the
    examples' own code, without an interpreter and its imports per rank and per example (the
    launch that re-runs a script per rank is tested by the main job's test and the failure
    reports'). An example that fails leaves the others to run. Under `IMPORTED`: what ``import
    lightning_canzona`` loaded in that interpreter, module names separated by spaces."""
    listed = [[str(folder), [str(script), *map(str, args)]] for script, folder, args in runs.values()]
    code, output = run_script("-c", _FORKED, json.dumps(listed), cwd=Path.cwd(), timeout=600)
    assert code == 0, output[-3000:]
    header, *parts = output.split(_BEGIN)
    results = {IMPORTED: (0, header.split(_LOADED, 1)[1].split("\n", 1)[0])}
    for name, part in zip(runs, parts, strict=True):
        printed, _, exit_code = part.split("\n", 1)[1].rpartition(_END)  # after the script's name
        results[name] = (int(exit_code.split()[0]), printed)
    return results
