"""python -m bench.aiperf: the same as `moorage bench aiperf`."""

import sys

from bench.aiperf.main import main

sys.exit(main())
