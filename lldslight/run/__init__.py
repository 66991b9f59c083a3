"""The run's own files and failures: what a run writes and how it stops, below every other layer.

- run_dir.py: a run directory never overwritten without ``--force``, and locked while written;
- writes.py: output directories and files checked before the work, and written whole;
- checkpoint_io.py: checkpoint files (atomic writes, every rank's RNG streams, the trainable-keys
  check, ``--ckpt_path last``) and the checks before one is read;
- config_files.py: ``--config`` YAML read safely (keys given twice, encoding, size bounds);
- deprecated_keys.py: the old flat model keys and where each lives now;
- hostmem.py: glibc malloc tunables, heap trims, the memory available now;
- metric_rules.py: how every logged metric is reduced across ranks and over a step's updates;
- stopping.py: what SIGTERM does by what the run is doing;
- events.py: metrics of events (a heal, a probe, a guard's stop), written once, on the row of their step.

None of them imports the policy, the update or the rollout. The modules are imported by their own
path (``from lldslight.run.writes import check_out_dir``); nothing is imported here.
"""
