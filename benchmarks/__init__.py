"""The speed tools: scripts, importable as modules (the collapse lab and the demo studies are in lab/).

Each script runs by path, ``python benchmarks/step.py`` (its own folder is then on ``sys.path``,
so it imports a sibling plainly: ``import harness``), or as a module from the repository root,
``python -m benchmarks.step`` (then it imports siblings relatively, ``from . import harness``, and
the root, on ``sys.path``, supplies this checkout's ``lldslight`` before any installed one: the
form to use in a git worktree that shares another checkout's virtual environment). Tests import
them as ``benchmarks.<name>``. No script edits ``sys.path``.
"""
