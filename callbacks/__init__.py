"""Your own callbacks live here (or in any module importable from where you run ``lldslight``).

Name them in YAML by ``class_path`` (see callbacks/README.md and configs/demo_with_table.yaml).
"""
