"""The ``canzona`` command.

- ``canzona fit|validate|test|predict``: LightningCLI. Configs are read in omegaconf mode, so YAML
  can interpolate (``${model.init_args.preset}``). Importing `lightning_canzona` registers the
  strategy, so ``strategy: canzona`` needs no import.
- ``canzona plan``: the optimizer plan of a model preset on a mesh, per policy, without weights.
- ``canzona bench``: benchmarks that run canzona and its alternatives side by side.
"""

from __future__ import annotations

import sys

from lightning.pytorch.cli import LightningCLI

import lightning_canzona  # noqa: F401  (registers the "canzona" strategies)


def main(args: list[str] | None = None) -> None:
    """Run the command on ``args`` (default: the command line)."""
    argv = sys.argv[1:] if args is None else list(args)
    if argv and argv[0] == "plan":
        from lightning_canzona.commands import plan

        plan.main(argv[1:])
        return
    if argv and argv[0] == "bench":
        from lightning_canzona.bench.__main__ import main as bench

        bench(argv[1:])
        return
    LightningCLI(
        subclass_mode_model=True,
        subclass_mode_data=True,
        parser_kwargs={"parser_mode": "omegaconf"},
        save_config_kwargs={"overwrite": True},
        args=argv,
    )


if __name__ == "__main__":
    main()
