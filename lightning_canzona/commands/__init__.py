"""Sub-commands of the ``canzona`` console command that are not LightningCLI's."""
