"""The collapse lab and the demo studies: experiments beside the library, not its API (lab/README.md).

Each script runs by path, ``python lab/collapse.py`` (its own folder is then on ``sys.path``, so
it imports a sibling plainly), or as a module from the repository root, ``python -m lab.collapse``
(then it imports siblings relatively, and the root, on ``sys.path``, supplies this checkout's
``lldslight`` before any installed one: the form to use in a git worktree that shares another
checkout's virtual environment). Tests import them as ``lab.<name>``. No script edits ``sys.path``.
"""
