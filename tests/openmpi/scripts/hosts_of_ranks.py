"""Reports each rank's host with mpi4py alone (no TensorFlow: a host file's placement is MPI's).

Each rank prints one line: HOST {"rank": r, "size": n, "host": hostname}.
"""

import json
import socket
import sys

from mpi4py import MPI

comm = MPI.COMM_WORLD
sys.stdout.write("HOST " + json.dumps({"rank": comm.rank, "size": comm.size, "host": socket.gethostname()}) + "\n")
sys.stdout.flush()
comm.Barrier()
