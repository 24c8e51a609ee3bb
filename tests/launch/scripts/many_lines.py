"""Every rank prints argv[1] lines at once, with print's several arguments (unbuffered, as under
PYTHONUNBUFFERED, that is several writes a line), of the lengths listed in argv[2] in turn:
`LINE rank=R n=N xxx...x END`, N counting from 0, as many x as the length. With --init it calls
kerasdist.init() first. Each rank says RANK_DONE when it has printed all.
"""

import os
import sys

if "--init" in sys.argv:
    import kerasdist

    kerasdist.init()
    rank = kerasdist.rank()
else:
    rank = int(os.environ.get("PMI_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or 0)

lines = int(sys.argv[1])
lengths = [int(length) for length in sys.argv[2].split(",")]
for n in range(lines):
    print(f"LINE rank={rank}", f"n={n}", "x" * lengths[n % len(lengths)], "END")
sys.stdout.flush()
print(f"RANK_DONE rank={rank}", flush=True)
