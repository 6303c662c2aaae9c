"""``python -m toolguard``: the same as the ``toolguard`` command."""

from toolguard.cli import app

app(prog_name="toolguard")
