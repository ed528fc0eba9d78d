"""`python -m composer ...`: the `composer` command, for launchers that run modules
(`torchrun --nproc-per-node=4 -m composer generate ... --ulysses-degree 4`)."""

import sys

from composer.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
