"""`python -m mt_train` runs the `mt-train` command line."""

import sys

from mt_train.cli import main

sys.exit(main())
