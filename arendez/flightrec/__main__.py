"""``python -m arendez.flightrec FILES...``: the analyzer of flight recorder dumps."""

import sys

from .analyze import main

sys.exit(main())
