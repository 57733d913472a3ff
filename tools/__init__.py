"""Tools run from the repository root with `python -m tools.<name>`; not part of the library."""
