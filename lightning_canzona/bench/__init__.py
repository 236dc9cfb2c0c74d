"""Benchmarks run as commands (never as tests): ``python -m lightning_canzona.bench --help``."""
