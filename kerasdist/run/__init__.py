"""The launcher: ``kerasdist-run -np N [options] command ...`` (or ``python -m kerasdist.run``).

Starts ``command`` as N ranks with the mpiexec kerasdist was built with, setting the engine's
knobs from flags. Depends on nothing above ``kerasdist.runtime`` and imports neither TensorFlow
nor MPI. Run ``kerasdist-run --help`` for the flags.
"""

from kerasdist.run.launcher import main

__all__ = ["main"]
