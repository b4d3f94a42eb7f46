"""`python -m layerscope ...`: the command line, also as torchrun starts it (`torchrun --nproc-per-node N -m
layerscope capture ...`): the process group is joined before any model loads, and only rank 0 prints results."""

import os
import sys

from layerscope import distributed
from layerscope.commands.cli import main

if __name__ == "__main__":
    distributed.init()
    if distributed.rank() != 0:
        sys.stdout = open(os.devnull, "w")     # one result on stdout; every rank's progress stays on stderr
    sys.exit(main())
