"""`python -m mt_train` runs the `mt-train` command line."""

from mt_train.cli import entry

entry()
