"""``python -m lldslight.cli ...``: the ``lldslight`` command (tests, the lab and the benchmarks run it so)."""
from lldslight.cli.command import main

raise SystemExit(main())
