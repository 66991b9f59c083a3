"""A ``--config`` YAML is read safely: one line naming the file (and line) for a key given twice, a
file that is not UTF-8, empty or not a mapping, a section given as null, and for a file that would
expand or nest past what the machine can hold (docs/errors_and_resume.md, "Configs are read
safely"). Each case runs the real CLI; nothing loads a model."""
from __future__ import annotations

import sys

import pytest
import yaml

from lldslight.errors import ConfigError
from tests.test_bad_input import TINY, assert_one_line_error, run_cli, subprocess_cli


def test_a_key_given_twice_is_refused_with_both_lines(tmp_path, capsys):
    cfg = tmp_path / "twice.yaml"
    cfg.write_text("model:\n  logprob_temperature: 1.0\n  logprob_chunk_size: 64\n  logprob_temperature: 0.5\n")
    code, err = run_cli(["fit", "--config", str(TINY), "--config", str(cfg)], tmp_path, capsys)
    assert_one_line_error(code, err, "fit", str(cfg), "line 4", "'logprob_temperature' is given twice", "first at line 2")


def test_two_top_level_blocks_are_refused(tmp_path, capsys):
    cfg = tmp_path / "blocks.yaml"
    cfg.write_text(TINY.read_text() + "\nmodel:\n  logprob_temperature: 0.5\n")
    code, err = run_cli(["fit", "--config", str(cfg)], tmp_path, capsys)
    first = next(i for i, line in enumerate(TINY.read_text().splitlines(), 1) if line.startswith("model:"))
    assert_one_line_error(code, err, "fit", str(cfg), "'model' is given twice", f"first at line {first}")


def test_a_merge_key_may_be_overridden(tmp_path):
    """``<<: *base`` then a key of base: YAML's own way to override, not a duplicate."""
    from lldslight.run import config_files

    text = "base: &b {logprob_temperature: 1.0, logprob_chunk_size: 64}\nmodel:\n  <<: *b\n  logprob_temperature: 2.0\n"
    assert config_files.load_text(text, "x.yaml", sections=False)["model"] == {"logprob_temperature": 2.0, "logprob_chunk_size": 64}


def test_a_billion_laughs_is_refused_at_once(tmp_path):
    """358 bytes that expand to 10^9 values: refused by name within seconds (a subprocess, so a
    regression ends in the timeout instead of eating the machine's memory)."""
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, 9):
        prev, cur = chr(ord("a") + i - 1), chr(ord("a") + i)
        lines.append(f"{cur}: &{cur} [" + ",".join([f"*{prev}"] * 9) + "]")
    cfg = tmp_path / "laughs.yaml"
    cfg.write_text("\n".join(lines) + "\n")
    proc = subprocess_cli(["fit", "--config", str(cfg)], tmp_path, timeout=120)
    assert_one_line_error(proc.returncode, proc.stderr, "fit", str(cfg), "expands to more than", "billion laughs")


def test_deep_nesting_is_refused_with_the_file(tmp_path, capsys):
    cfg = tmp_path / "deep.yaml"
    cfg.write_text("model: " + "[" * 20000 + "]" * 20000 + "\n")
    code, err = run_cli(["fit", "--config", str(cfg)], tmp_path, capsys)
    assert_one_line_error(code, err, "fit", str(cfg), "nested more than", "levels deep")


def test_a_latin1_byte_is_named_with_its_offset(tmp_path, capsys):
    cfg = tmp_path / "latin1.yaml"
    data = "trainer:\n  max_steps: 2\n# caf\xe9\n".encode("latin-1")
    cfg.write_bytes(data)
    code, err = run_cli(["fit", "--config", str(TINY), "--config", str(cfg)], tmp_path, capsys)
    offset = data.index(b"\xe9")  # independent of the decoder: where the byte was written
    assert_one_line_error(code, err, "fit", str(cfg), "not UTF-8", f"offset {offset}", "line 3")


@pytest.mark.parametrize("overlay", [False, True], ids=["alone", "overlay"])
def test_an_empty_config_is_named(tmp_path, capsys, overlay):
    cfg = tmp_path / "empty.yaml"
    cfg.write_text("# nothing yet\n")
    args = ["fit", *(["--config", str(TINY)] if overlay else []), "--config", str(cfg)]
    code, err = run_cli(args, tmp_path, capsys)
    assert_one_line_error(code, err, "fit", str(cfg), "is empty")


@pytest.mark.parametrize("text, needle", [("model: null\n", "model must be a mapping of settings, got None"),
                                          ("- a\n- b\n", "must be a mapping of settings (key: value), got a list")])
def test_a_section_or_file_of_the_wrong_shape_is_named(tmp_path, capsys, text, needle):
    cfg = tmp_path / "shape.yaml"
    cfg.write_text(text)
    code, err = run_cli(["fit", "--config", str(TINY), "--config", str(cfg)], tmp_path, capsys)
    assert_one_line_error(code, err, "fit", str(cfg), needle)


def count_values(tree) -> int:
    """Nodes of a loaded document, counted by walking it (aliases are shared objects here, so each
    reference is walked again: the expansion a copying reader makes)."""
    if isinstance(tree, dict):
        return 1 + sum(1 + count_values(v) for v in tree.values())
    if isinstance(tree, list):
        return 1 + sum(count_values(v) for v in tree)
    return 1


def test_the_expansion_bound_is_the_expanded_size(monkeypatch):
    """The bound counts what the document expands to: a document of N values passes with a budget
    of N and is refused with N - 1 (N counted independently, by walking the loaded document)."""
    from lldslight.run import config_files

    text = "a: &a [1, 2, 3]\nb: &b [*a, *a, *a]\nc: [*b, *b, {k: *a}]\n"
    n = count_values(yaml.safe_load(text))
    monkeypatch.setattr(config_files, "available_memory", lambda: n * config_files.NODE_BYTES * config_files.MEMORY_SHARE)
    config_files.check_text(text, "x.yaml")
    monkeypatch.setattr(config_files, "available_memory",
                        lambda: (n - 1) * config_files.NODE_BYTES * config_files.MEMORY_SHARE)
    with pytest.raises(ConfigError, match="expands to more than"):
        config_files.check_text(text, "x.yaml")


def test_the_depth_bound_follows_the_recursion_limit(monkeypatch):
    from lldslight.run import config_files

    limit = sys.getrecursionlimit() // config_files.FRAMES_PER_LEVEL
    config_files.check_text("[" * limit + "]" * limit, "x.yaml")
    with pytest.raises(ConfigError, match=f"nested more than {limit} levels"):
        config_files.check_text("[" * (limit + 1) + "]" * (limit + 1), "x.yaml")


def test_data_synth_reads_its_config_as_safely(tmp_path):
    cfg = tmp_path / "synth.yaml"
    cfg.write_text("data:\n  synthesize: {out_dir: a}\n  synthesize: {out_dir: b}\n")
    proc = subprocess_cli(["data", "synth", "--config", str(cfg)], tmp_path, timeout=120)
    assert_one_line_error(proc.returncode, proc.stderr, "data", str(cfg), "'synthesize' is given twice")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
