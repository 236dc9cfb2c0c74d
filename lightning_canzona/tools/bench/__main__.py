"""``python -m lightning_canzona.tools.bench``: ``canzona bench`` without the console script."""

from lightning_canzona.tools.bench import main

if __name__ == "__main__":
    main()
