"""The collapse science: when a run collapsed, what warned of it, and the plots that show both.

- collapse.py: the collapse criterion over a run's logged metrics (reward and answered rate only,
  no detector), and the statistics that compare arms of runs (docs/results.md, Words used below);
- diagnostics.py: the lazy-likelihood-displacement diagnostics as pure functions, and the phase
  detector (docs/diagnostics.md); the ``LLDMonitor`` callback logs them;
- alarm.py: the collapse alarm's rule, CUSUM over standardised signals (docs/alarm_and_healing.md);
  the ``CollapseAlarm`` callback feeds it every step;
- plots.py: ``lldslight plot``, the diagnostics, phases, alarm and heals of one or more runs.

None of them imports Lightning; the callbacks in lldslight/callbacks/ are their way into a run.
The modules are imported by their own path (``from lldslight.science.alarm import AlarmConfig``);
nothing is imported here, so reading a collapse verdict does not load torch or matplotlib.
"""
