"""``python -m orchestrator``: the command line (orchestrator/cli/)."""

from orchestrator.cli import main

main()
