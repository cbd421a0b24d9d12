"""Command-line interface: `rayrl <command>`; each command lives in its own module."""
