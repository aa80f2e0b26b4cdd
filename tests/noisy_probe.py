"""Stand-in for train.py in launch tests: every rank writes whole lines to stdout and
stderr at once, as training output and warnings do, so the launcher's prefixing can be
checked line by line."""

import os
import sys

rank = os.environ["RANK"]
for i in range(300):
    for stream in (sys.stdout, sys.stderr):
        stream.write(f"noisy: rank={rank} line={i} {'x' * 200} end\n")
        stream.flush()
