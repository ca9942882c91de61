"""`python -m mt_data` runs the `mt-data` command line."""

from mt_data.cli import main

# Guarded: spawned builder workers import this module again (as `__mp_main__`).
if __name__ == "__main__":
    raise SystemExit(main())
