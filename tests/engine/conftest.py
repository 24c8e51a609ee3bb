"""The engine tests start their own mpiexec jobs with the launch tests' runner."""

import sys
from pathlib import Path

# launch_utils: output to a file, timeouts, leftover ranks killed.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "launch"))
