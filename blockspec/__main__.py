"""`python -m blockspec`: the command line (what torchrun starts: `torchrun --nproc-per-node N -m blockspec
train-drafter ...`)."""

import sys

from .cli import main

sys.exit(main())
