"""`python -m tgis_bench`: the same as the `tgis-bench` command."""

import sys

from tgis_bench.cli import main

sys.exit(main())
