"""Train agents with MAGRPO-MT: `python train.py [key=value ...]` (see README.md and docs/)."""
import sys

from magrpo.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
