"""Benchmark, validation and reproduction scripts, each run as `python launch/NAME.py`.

A package so that tests and sibling scripts import them as `launch.NAME`; no script does
any work on import (each runs under `if __name__ == "__main__"`).
"""
