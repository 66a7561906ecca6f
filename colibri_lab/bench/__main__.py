"""``python -m colibri_lab.bench``: the side-by-side benchmark (see the package docstring)."""

import sys

from .side_by_side import main

sys.exit(main())
