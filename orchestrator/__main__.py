"""``python -m orchestrator``: the command line (orchestrator/cli/)."""

from orchestrator.node import collector

collector.tune()  # before the imports: orchestrator/node/collector.py

from orchestrator.cli import main  # noqa: E402

main()
