"""`python -m tensorstep` runs the CLI."""
from .cli import main

main()
