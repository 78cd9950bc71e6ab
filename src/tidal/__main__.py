"""`python -m tidal ...` (and `torchrun -m tidal ...`) run the same CLI as the `tidal` command."""

from tidal.cli import main

if __name__ == "__main__":
    main()
