"""Your own callbacks live here (or in any module importable from where you run ``lldslight``).

Name them in YAML by ``class_path``. ``trajectory_table.py`` keeps an old name of the library's
per-turn table (lldslight/callbacks/traces.py, a callback to copy from); docs/architecture.md
("Your own reward or callback") says what a callback can read and register.
"""
