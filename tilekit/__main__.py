"""`python -m tilekit` is the `tilekit` command."""

import sys

from tilekit.cli import main

sys.exit(main())
