"""RunSummary's command time and machine line, against hand-worked values."""
from __future__ import annotations

from lldslight.callbacks.summary import STARTED_ENV, command_time_s, machine_line


def test_command_time_counts_from_the_launchers_start(monkeypatch):
    monkeypatch.setenv(STARTED_ENV, "1000")
    assert command_time_s(now=1100.5) == 100.5
    monkeypatch.setenv(STARTED_ENV, "1733400000.25")
    assert abs(command_time_s(now=1733400243.0) - 242.75) < 1e-9


def test_command_time_is_absent_where_no_launcher_set_it(monkeypatch):
    monkeypatch.delenv(STARTED_ENV, raising=False)
    assert command_time_s(now=5.0) is None
    monkeypatch.setenv(STARTED_ENV, "")
    assert command_time_s(now=5.0) is None
    monkeypatch.setenv(STARTED_ENV, "yesterday")  # not a time: no figure rather than a wrong one
    assert command_time_s(now=5.0) is None


def test_machine_line_names_the_cpu_its_kernel_flags_and_threads():
    xeon = {"cpu_model": "Intel(R) Xeon(R) Processor",
            "cpu_flags_simd": ["amx_bf16", "amx_int8", "amx_tile", "avx", "avx2", "avx512_bf16", "avx512f", "avx512vl", "fma"]}
    assert machine_line({**xeon, "threads": 2}) == "Intel(R) Xeon(R) Processor (amx_bf16, amx_tile, avx2, avx512_bf16, avx512f), 2 thread(s)"
    epyc_avx2 = {"cpu_model": "AMD EPYC 7B13", "cpu_flags_simd": ["avx", "avx2", "fma", "sse4_1"]}
    assert machine_line({**epyc_avx2, "threads": 1}) == "AMD EPYC 7B13 (avx2), 1 thread(s)"
    assert machine_line({"cpu_model": "", "cpu_flags_simd": ["sse4_2"], "threads": 4}) == "unknown CPU (no AVX2), 4 thread(s)"
