"""The collapse lab's helper scripts (docs/collapse_lab.md); run by path or as
``python -m benchmarks.lab.<name>`` (benchmarks/__init__.py says which ``lldslight`` each form imports)."""
