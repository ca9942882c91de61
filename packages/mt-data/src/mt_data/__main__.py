"""`python -m mt_data` runs the `mt-data` command line."""

from mt_data.cli import main

raise SystemExit(main())
