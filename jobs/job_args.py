"""Argument types for the jobs' command lines: a nonsense value is an argparse error (exit 2)
that says what was expected, what came and what to pass instead."""

import argparse
import math
import os


def integer(minimum, what, example):
    """An int >= ``minimum``; ``what`` names the value, ``example`` is a good one."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(
                f"expected an integer >= {minimum} ({what}), got {text!r}; for example {example}")
        return value
    parse.__name__ = f"integer >= {minimum}"  # argparse names the type in some messages
    return parse


def real(what, example, positive=False, below=None):
    """A finite float, > 0 with ``positive``, else >= 0 (no nan, no inf); < ``below`` if given."""
    bound = "> 0" if positive else ">= 0"
    if below is not None:
        bound += f" and < {below:g}"

    def parse(text):
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if (not math.isfinite(value) or value < 0 or (positive and value == 0)
                or (below is not None and value >= below)):
            raise argparse.ArgumentTypeError(
                f"expected a finite number {bound} ({what}), got {text!r}; for example {example}")
        return value
    parse.__name__ = f"number {bound}"
    return parse


def directory(text):
    """A directory path, existing or to be created: not empty, not an existing file (found
    here, before training, rather than by rank 0 alone at its first save)."""
    if not text:
        raise argparse.ArgumentTypeError("expected a directory path, got ''; for example "
                                         "checkpoints")
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"expected a directory, got {text!r}, which is a "
                                         f"file; pass another path (it is created if missing)")
    return text
