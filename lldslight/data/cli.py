"""`lldslight data ...`: generate the synthetic knowledge base, inspect a data file."""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from itertools import islice
from pathlib import Path
from typing import Optional

from lldslight.data.formats import DataFormatError, iter_corpus, load_examples
from lldslight.data.synth import synthesize
from lldslight.errors import ArgumentParser, require


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="lldslight data", description="Data tools.")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("synth", help="generate the synthetic knowledge base (idempotent)")
    where = s.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", help="output directory")
    where.add_argument("--config", help="an lldslight fit YAML: use its data.synthesize (out_dir, seed, ...), "
                                        "so a script makes the knowledge base that config trains on")
    s.add_argument("--seed", type=int, default=None, help="default 0")
    s.add_argument("--entities", type=int, default=None, help="default 200")
    s.add_argument("--dev", type=int, default=None, help="dev questions (default 64)")
    s.add_argument("--test", type=int, default=None, help="test questions (default 64)")
    s.add_argument("--force", action="store_true",
                   help="replace files of the same names (train.jsonl, corpus.jsonl, ...) that an earlier synthesis did not write")
    i = sub.add_parser("inspect", help="counts per data_source and 3 examples of a question or corpus file")
    i.add_argument("file", help=".parquet, .jsonl, .json, or a saved HF dataset directory")
    i.add_argument("--split", default=None, help="split of a saved HF DatasetDict")
    return p


def _synth_args_from_config(path: str) -> dict:
    from lldslight.run.config_files import load_file

    config = load_file(path)
    synth = ((config or {}).get("data") or {}).get("synthesize") if isinstance(config, dict) else None
    require(isinstance(synth, dict) and "out_dir" in synth, f"{path}: data.synthesize", "a mapping with an out_dir", synth)
    return dict(synth)


def _inspect(path: str, split: Optional[str]) -> int:
    try:
        examples = load_examples(path, split=split)
    except DataFormatError as e:
        if "is a corpus" not in str(e):
            raise
        n = 0
        head = []
        for row in iter_corpus(path):
            if n < 3:
                head.append(row)
            n += 1
        print(f"{path}: corpus, {n} passages")
        for row in head:
            print(json.dumps(row, ensure_ascii=False)[:300])
        return 0
    counts = Counter(ex.data_source for ex in examples)
    print(f"{path}: {len(examples)} questions")
    for source, n in sorted(counts.items()):
        print(f"  {source}: {n}")
    for ex in islice(examples, 3):
        print(json.dumps({"id": ex.id, "data_source": ex.data_source, "split": ex.split,
                          "question": ex.question, "golden_answers": ex.golden_answers}, ensure_ascii=False))
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.command == "synth":
            kwargs = _synth_args_from_config(args.config) if args.config else {"out_dir": args.out}
            kwargs.update({k: v for k in ("seed", "entities", "dev", "test") if (v := getattr(args, k)) is not None})
            paths = synthesize(**kwargs, force=args.force)
            manifest = json.loads(Path(paths["manifest"]).read_text())
            print(json.dumps({"out": str(kwargs["out_dir"]), "counts": manifest["counts"]}, indent=2))
            return 0
        return _inspect(args.file, args.split)
    except (DataFormatError, FileNotFoundError, ValueError) as e:
        print(f"lldslight data: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
