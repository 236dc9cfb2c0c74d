"""Run a user's script as a user would, and never leave a process of it behind."""

from __future__ import annotations

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


#: Runs the example script ``sys.argv[1]`` with the rest as its arguments, every
#: `CanzonaStrategy` it builds forking its ranks from this one interpreter.
_FORKED = """
import functools, runpy, sys
import lightning_canzona as lc
lc.CanzonaStrategy = functools.partial(lc.CanzonaStrategy, start_method="fork")
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_example_forked(example: Path, *arguments: object, cwd: Path) -> tuple[int, str]:
    """`run_script` of an example whose Trainer is built with `CanzonaStrategy`, its ranks forked
    instead of re-running the script once each: the example's own code, without an interpreter
    and its imports per rank (the README's launches are tested as users run them)."""
    return run_script("-c", _FORKED, example, *arguments, cwd=cwd)
