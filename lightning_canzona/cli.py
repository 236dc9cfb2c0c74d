"""The ``canzona`` command: LightningCLI (``fit``, ``validate``, ``test``, ``predict``).

Configs are read in omegaconf mode, so YAML can interpolate (``${model.init_args.preset}``).
Importing `lightning_canzona` registers the strategy, so ``strategy: canzona`` needs no import.
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningCLI

import lightning_canzona  # noqa: F401  (registers the "canzona" strategies)


def main(args: list[str] | None = None) -> None:
    """Run the CLI on ``args`` (default: the command line)."""
    LightningCLI(
        subclass_mode_model=True,
        subclass_mode_data=True,
        parser_kwargs={"parser_mode": "omegaconf"},
        save_config_kwargs={"overwrite": True},
        args=args,
    )


if __name__ == "__main__":
    main()
