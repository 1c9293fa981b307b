"""``python -m clemprm``: the same as the ``clemprm`` console command."""

import sys

from clemprm.cli import main

sys.exit(main())
