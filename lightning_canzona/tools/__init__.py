"""The tools around the library: the commands of ``canzona`` other than LightningCLI's, and what
they are built from. ``import lightning_canzona`` loads none of them; each loads when its command
runs (`lightning_canzona.cli.COMMANDS`), or when a test or a user imports it.

- `plan`: ``canzona plan``, a model's optimizer plan per policy without weights, with the
  balance `plan.sweep` and the projections of `simulation` (traffic, step, iteration);
- `bench`: ``canzona bench``, canzona against the alternatives (figures in docs/benchmarks.md);
- `doctor`: ``canzona doctor``, this machine checked (docs/doctor.md);
- `export`: ``canzona export``, the command line of `lightning_canzona.export_checkpoint`;
- `command`: a command's options from its function's signature (jsonargparse), `tables`: the
  tables they print (rich), `checks`: what the doctor checks and the tests check too.
"""
