"""Whole-number settings from HPCGRAD_* variables: one parser, one wording for a bad value."""

import os


def whole_number(name, minimum, meaning, default=None, environ=os.environ):
    """``environ[name]`` as an int >= ``minimum``; ``default`` when unset or empty. Anything else
    is a ValueError: '<name> must be <meaning>, got <the value>'."""
    raw = environ.get(name, "").strip()
    if raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise ValueError(f"{name} must be {meaning}, got {raw!r}")
    return value
