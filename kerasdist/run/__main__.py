"""``python -m kerasdist.run ...`` behaves exactly like ``kerasdist-run ...``."""

import sys

from kerasdist.run.launcher import main

sys.exit(main())
