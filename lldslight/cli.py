"""The ``lldslight`` command: LightningCLI's fit / validate / test, plus data, index, serve, plot
and export. Training runs are configured by YAML (``--config``, repeatable, later files win);
``lldslight fit --print_config`` shows every knob with its default.

One rule for bad input, every command: a configuration or data error (an unknown key, a value out
of range, a missing or malformed file, an unreachable retriever, a model that is not on disk)
prints ``lldslight <command>: error: <message>`` and exits with status 2, without a traceback.
``--debug`` (anywhere on the command line) or ``LLDSLIGHT_DEBUG=1`` shows the traceback instead.
"""
from __future__ import annotations

import copy
import importlib
import inspect
import logging
import os
import re
import sys
import traceback
from pathlib import Path
from typing import Any, Optional

# name -> "module:function"; each takes argv (list[str]) and returns an exit code.
TOOLS = {
    "data": ("lldslight.data.cli:main", "synthesise or inspect data: lldslight data synth --out DIR"),
    "index": ("lldslight.retrieval.cli:index_main", "build a BM25 or dense index over a corpus jsonl"),
    "serve": ("lldslight.retrieval.cli:serve_main", "serve an index over Search-R1's HTTP API"),
    "plot": ("lldslight.science.plots:main", "plot the LLD diagnostics of one or more runs"),
    "sft": ("lldslight.sft:main", "supervised warm start on gold search trajectories (before GRPO)"),
    "export": ("lldslight.policy.export:main", "merge the adapter of a checkpoint into a HF model directory"),
}
DEBUG_ENV = "LLDSLIGHT_DEBUG"


def _plain_list_keys(tree: Any, prefix: str = "") -> list[str]:
    """Dotted keys of a config mapping whose value is a list written without ``+``."""
    keys: list[str] = []
    if isinstance(tree, dict):
        for k, v in tree.items():
            if not isinstance(k, str) or k.endswith("+"):
                continue
            if isinstance(v, list):
                keys.append(prefix + k)
            elif isinstance(v, dict):
                keys.extend(_plain_list_keys(v, f"{prefix}{k}."))
    return keys


def _read_config(value: Any) -> Any:
    """The mapping a ``--config`` value holds (a file, or an inline YAML/JSON string)."""
    import yaml

    text = str(value)
    try:
        if os.path.isfile(text):
            with open(text) as f:
                return yaml.safe_load(f)
        return yaml.safe_load(text)
    except (OSError, yaml.YAMLError):
        return None  # jsonargparse reports it


def _cli_class():
    from jsonargparse import ActionConfigFile
    from lightning.pytorch.cli import LightningCLI

    from lldslight.run import stopping
    from lldslight.run.checkpoint_io import resolve_last_checkpoint
    from lldslight.data.datamodule import SearchQADataModule
    from lldslight.errors import UserError
    from lldslight.module import GRPOModule
    from lldslight.run.checkpoint_io import check_checkpoint

    class ConfigFile(ActionConfigFile):
        """``--config`` where a list written ``key:`` replaces the list of an earlier config and
        ``key+:`` appends to it. (jsonargparse alone merges two lists of equal length item by
        item, so a second file's ``callbacks:`` would keep the first file's init_args.)"""

        @staticmethod
        def apply_config(parser, cfg, dest, value) -> None:
            tree = _read_config(value)
            _refuse_flat_keys(tree.get("model") if isinstance(tree, dict) else None, f"{value}: ")
            for key in _plain_list_keys(tree):
                if isinstance(cfg.get(key), list):
                    cfg[key] = None
            ActionConfigFile.apply_config(parser, cfg, dest, value)

    class CLI(LightningCLI):
        def init_parser(self, **kwargs: Any):
            import lightning.pytorch as pl

            kwargs.setdefault("dump_header", [f"lightning.pytorch=={pl.__version__}"])
            parser = self.parser_class(**kwargs)
            parser.add_argument("-c", "--config", action=ConfigFile,
                                help="Path to a configuration file in json or yaml format (repeatable; later files "
                                     "win, a list written `key:` replaces, `key+:` appends).")
            return parser

        def add_arguments_to_parser(self, parser) -> None:
            parser.add_argument(
                "--resume_override", type=Optional[str], default=None,
                help="With --ckpt_path: model settings to take from your config and command line instead of the "
                     "checkpoint's saved ones: comma-separated keys (e.g. model.optim.lr,model.update.clip_eps) or 'all'. "
                     "Without it a resume is exact: the checkpoint's settings win, and every one that differs "
                     "from yours is listed in one line at start (docs/errors_and_resume.md).")
            # nargs="?" and const: `--force` alone is the flag every refusal advises; `--force true`
            # (and `force: true` in YAML) work as before.
            parser.add_argument(
                "--force", type=bool, nargs="?", const=True, default=False,
                help="Replace the run a run directory already holds (a fixed trainer.logger.init_args.version whose "
                     "metrics.csv or checkpoints exist): its files are listed, then removed, before this run starts. "
                     "Not needed to resume that run (fit --ckpt_path last): its metrics are kept.")

        def parse_arguments(self, parser, args) -> None:
            words = sys.argv[1:] if args is None else args if isinstance(args, (list, tuple)) else []
            flags = [w.split("=", 1)[0][len("--model."):] for w in words if isinstance(w, str) and w.startswith("--model.")]
            _refuse_flat_keys(flags, "the command line: ")
            super().parse_arguments(parser, args)
            check_groups(parser, self.config)
            # Before LightningCLI reads the checkpoint's hyper-parameters (a corrupt file would end
            # there in a zip-reader traceback).
            if self.config.get("subcommand"):
                check_checkpoint(self.config[self.config.subcommand].get("ckpt_path"))

        def _parse_ckpt_path(self) -> None:
            # LightningCLI merges the checkpoint's hyper-parameters over the config here, silently.
            # `--ckpt_path last` is resolved first so that it gets the same treatment as a path.
            sub = self.config.get("subcommand")
            if not sub:
                return super()._parse_ckpt_path()
            resolve_last_checkpoint(self.config[sub], sub)
            check_checkpoint(self.config[sub].get("ckpt_path"))
            yours = self.config[sub].get("model")
            yours = yours.clone() if yours is not None else None
            self._merge_checkpoint_hparams(sub)
            self.resume = resume_settings(self.config, sub, yours)

        def _merge_checkpoint_hparams(self, sub: str) -> None:
            """LightningCLI's own merge of the checkpoint's hyper-parameters over the config (its
            _parse_ckpt_path), with the flat keys an earlier lldslight saved (set before the groups,
            null since) folded into the groups first: the parser knows the groups only."""
            import torch

            from lldslight.run import deprecated_keys

            ckpt_path = self.config[sub].get("ckpt_path")
            if not ckpt_path or not Path(ckpt_path).is_file():
                return
            hparams = torch.load(ckpt_path, weights_only=True, map_location="cpu").get("hyper_parameters", {})
            hparams.pop("_instantiator", None)
            if not hparams:
                return
            hparams = deprecated_keys.nested(hparams)
            if "_class_path" in hparams:
                hparams = {"class_path": hparams.pop("_class_path"), "dict_kwargs": hparams}
            try:
                self.config = self.parser.parse_object({sub: {"model": hparams}}, self.config)
            except SystemExit:
                sys.stderr.write("Parsing of ckpt_path hyperparameters failed!\n")
                raise

        def _run_subcommand(self, subcommand: str) -> None:
            from lldslight.run.run_dir import is_rank_zero

            sub = self.config[subcommand]
            locks = _claim_run_dirs(self.trainer, bool(sub.get("force")), sub.get("ckpt_path"), subcommand) if is_rank_zero() else []
            previous = stopping.install()
            try:
                _check_wandb_online(self.trainer)
                super()._run_subcommand(subcommand)
            except SystemExit as err:  # Lightning's graceful stop after Ctrl-C or SIGTERM
                raise _stopped(self.trainer, subcommand) or err
            except Exception as err:
                _remove_empty_run_dirs(self.trainer)
                if isinstance(err, UserError) and getattr(self, "resume", None) is not None:
                    raise self.resume.explain(err) from err
                raise
            finally:
                for lock in locks:
                    lock.release()
                stopping.restore(previous)

        def before_instantiate_classes(self) -> None:
            _flags_to_first_logger(self)

        def _instantiate_trainer(self, config: dict[str, Any], callbacks: list) -> Any:
            check_stateful_callbacks(list(config.get("callbacks") or []) + list(callbacks))
            return super()._instantiate_trainer(config, callbacks)

        def instantiate_classes(self) -> None:
            try:
                super().instantiate_classes()
            except Exception as original:
                err = _instantiation_error(original)
                if isinstance(err, UserError) and getattr(self, "resume", None) is not None:
                    err = self.resume.explain(err)
                if err is original:
                    raise
                raise err from original

    return CLI, GRPOModule, SearchQADataModule


def _instantiation_error(err: Exception) -> Exception:
    """An error raised while building the configured objects: a UserError, a ValueError (Python's
    "bad value") or an ImportError (a missing optional package) raised by a class's ``__init__`` is
    a configuration error. jsonargparse wraps it,
    e.g. in "Does not validate against any of the Union subtypes" with every alternative's error;
    dig it out of the chain. Anything else stays what it is (a bug keeps its traceback)."""
    from lldslight.errors import ConfigError, UserError

    chain, e = [], err
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    for e in chain:
        if isinstance(e, UserError):
            return e
    for e in chain:
        if isinstance(e, MisconfigurationException):  # Lightning's word for a bad Trainer argument
            return ConfigError(re.sub(r"^`(\w+)`", r"trainer.\1", str(e).strip().splitlines()[0]))
    innermost = chain[-1]
    if isinstance(innermost, ValueError):
        return ConfigError(str(innermost))
    if isinstance(innermost, ImportError):  # an optional package the configured class needs
        hint = " (TensorBoardLogger: pip install -e '.[tensorboard]' in your lldslight clone)" if "tensorboard" in str(innermost) else ""
        return UserError(str(innermost).splitlines()[0] + hint)
    return err


def check_groups(parser: Any, config: Any) -> None:
    """Every group of settings (``model``, ``model.update``, ``model.optim``, ``data``, ...: a class
    or dataclass whose fields are keys) must be a mapping in the parsed config. jsonargparse keeps a
    null, a list or a scalar written in a group's place and fails later, when it builds the class, in
    a TypeError about functools.partial that names no key."""
    from lldslight.errors import ConfigError

    sub = config.get("subcommand")
    if sub:
        parser, config = parser._subcommands_action._name_parser_map[sub], config[sub]
    for key, group in sorted(parser.groups.items()):
        cls = getattr(group, "group_class", None)
        if cls is None or key not in config:
            continue
        value = config.get(key)
        if value is None or not hasattr(value, "as_dict"):  # a Namespace is a mapping of settings
            fields = [p.name for p in inspect.signature(cls).parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD][:4]
            shown = f" ({cls.__name__}: {', '.join(fields)}, ...)" if fields else ""
            leaf = key.rpartition(".")[2]
            raise ConfigError(f"{key} must be a mapping of settings{shown}, got {value!r}"
                              + (f" (an empty `{leaf}:` line? leave it out for the defaults)" if value is None else ""))


def check_stateful_callbacks(callbacks: list) -> None:
    """Two callbacks Lightning would store under one checkpoint key (a stateful callback class given
    twice, Lightning's own rule: ``state_dict`` overridden, the same ``state_key``) are said in one
    line, before the trainer refuses them in a 33-line RuntimeError."""
    from lightning.pytorch import Callback
    from lightning.pytorch.utilities.model_helpers import is_overridden

    from lldslight.errors import ConfigError

    seen: dict[Any, int] = {}
    for i, callback in enumerate(callbacks, start=1):
        if not isinstance(callback, Callback) or not is_overridden("state_dict", instance=callback, parent=Callback):
            continue
        key = callback.state_key
        if key in seen:
            raise ConfigError(f"trainer.callbacks: {type(callback).__qualname__} is given twice (entries {seen[key]} and {i}); a checkpoint "
                              "keeps one state per stateful callback class, so Lightning runs only one: remove one "
                              "(the overlays composed with `callbacks+:` may each add it)")
        seen[key] = i


def _refuse_flat_keys(model: Any, where: str) -> None:
    """One line naming the new place of each flat model key (``model.lr``: now ``model.optim.lr``)
    that ``model`` (a config's ``model:`` mapping, or the keys after ``--model.``) holds, before the
    parse and the model (lldslight/run/deprecated_keys.py)."""
    from lldslight.run import deprecated_keys
    from lldslight.errors import ConfigError

    found = deprecated_keys.flat_keys_in(model) if isinstance(model, dict) else [k for k in model or () if k in deprecated_keys.GROUP_OF]
    if found:
        raise ConfigError(where + deprecated_keys.moved(found))


# -- resume: what the checkpoint's settings changed ----------------------------------------------


def _leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted keys -> values of a nested mapping; a mapping on one side and not the other (a LoRA
    config vs null) is compared whole, at its own key."""
    out: dict[str, Any] = {}
    for k, v in (tree or {}).items():
        if isinstance(v, dict) and v:
            out.update(_leaves(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = list(v) if isinstance(v, tuple) else v
    return out


def _differences(yours: dict, checkpoint: dict) -> list[str]:
    """Keys whose value differs, at the coarsest level where one side is a mapping and the other not."""
    keys: list[str] = []
    for k in sorted(set(yours) | set(checkpoint)):
        a, b = yours.get(k), checkpoint.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            keys += [f"{k}.{sub}" for sub in _differences(a, b)]
        elif (list(a) if isinstance(a, tuple) else a) != (list(b) if isinstance(b, tuple) else b):
            keys.append(k)
    return keys


def _show(value: Any) -> str:
    return repr(value) if isinstance(value, str) else str(list(value) if isinstance(value, tuple) else value)


class ResumeSettings:
    """The model settings a resume took from its checkpoint where they differ from the config and
    command line (LightningCLI merges the checkpoint's hyper-parameters over them), and those that
    ``--resume_override`` gave back to the config."""

    def __init__(self, ckpt: str, taken: dict[str, tuple[Any, Any]], overridden: dict[str, tuple[Any, Any]]):
        self.ckpt = ckpt
        self.taken = taken  # key -> (checkpoint's value, yours), kept from the checkpoint
        self.overridden = overridden  # key -> (checkpoint's value, yours), yours used

    def line(self) -> Optional[str]:
        if not self.taken and not self.overridden:
            return None
        parts = []
        if self.taken:
            kept = ", ".join(f"model.{k}={_show(c)} (yours: {_show(y)})" for k, (c, y) in self.taken.items())
            parts.append(f"{len(self.taken)} setting(s) taken from the checkpoint, not your config: {kept}")
        if self.overridden:
            used = ", ".join(f"model.{k}={_show(y)} (checkpoint: {_show(c)})" for k, (c, y) in self.overridden.items())
            parts.append(f"yours by --resume_override: {used}")
        hint = (f"; --resume_override {','.join('model.' + k for k in self.taken)} (or all) uses yours"
                if self.taken else "")
        return f"[lldslight] resuming from {self.ckpt}: " + "; ".join(parts) + hint

    def explain(self, err: Exception) -> Exception:
        """``err`` with the settings that came from the checkpoint: an error about a model path that
        is in no config of yours must say where it came from."""
        from lldslight.errors import UserError

        if not self.taken or not isinstance(err, UserError):
            return err
        shown = ", ".join(f"model.{k}={_show(c)}" for k, (c, _) in list(self.taken.items())[:5])
        more = f" and {len(self.taken) - 5} more" if len(self.taken) > 5 else ""
        message = (f"{err} (resuming from checkpoint {self.ckpt}, whose saved settings replaced yours: {shown}{more}; "
                   "is it a checkpoint of this config? --resume_override all uses yours)")
        try:
            return type(err)(message)
        except TypeError:  # an error class with its own constructor
            return UserError(message)


def _override_keys(value: Optional[str], known: set[str]) -> Optional[set[str]]:
    """The keys ``--resume_override`` names (without "model."), None for 'all'."""
    from lldslight.errors import ConfigError

    if value is None or not str(value).strip():
        return set()
    text = str(value).strip()
    if text.lower() in ("all", "true"):
        return None
    from lldslight.run import deprecated_keys

    keys = set()
    for raw in text.split(","):
        key = raw.strip().removeprefix("model.")
        if not key:
            continue
        if key in deprecated_keys.GROUP_OF:
            raise ConfigError("--resume_override: " + deprecated_keys.moved([key]))
        if not any(key == k or k.startswith(key + ".") for k in known):
            raise ConfigError(f"--resume_override: {raw.strip()!r} is not a model setting (give keys such as "
                              "model.optim.lr, model.policy.lora.r, comma-separated, or 'all')")
        keys.add(key)
    return keys


def resume_settings(config: Any, sub: str, yours: Any) -> Optional[ResumeSettings]:
    """After LightningCLI merged a checkpoint's hyper-parameters into ``config[sub].model``: list what
    they changed, give the keys ``--resume_override`` names back to ``yours``, and say it in one line."""
    from lightning.pytorch.utilities import rank_zero_only

    ckpt = config[sub].get("ckpt_path")
    merged = config[sub].get("model")
    if yours is None or merged is None or not ckpt or not os.path.isfile(str(ckpt)):
        return None
    mine, theirs = yours.as_dict(), merged.as_dict()
    differ = _differences(mine, theirs)
    wanted = _override_keys(config[sub].get("resume_override"), set(_leaves(mine)) | set(_leaves(theirs)))
    taken, overridden = {}, {}
    for key in differ:
        pair = (_lookup(theirs, key), _lookup(mine, key))
        if wanted is None or any(key == w or key.startswith(w + ".") for w in wanted):
            leaf, value = _setting(yours, key)
            config[f"{sub}.model.{leaf}"] = value.clone() if hasattr(value, "clone") else copy.deepcopy(value)
            overridden[key] = pair
        else:
            taken[key] = pair
    settings = ResumeSettings(str(ckpt), taken, overridden)
    line = settings.line()
    if line:
        rank_zero_only(lambda: print(line, file=sys.stderr, flush=True))()
    return settings


def _setting(namespace: Any, key: str) -> tuple[str, Any]:
    """The setting of ``namespace`` that holds ``key`` and its value: ``key`` itself, or the
    mapping-valued setting above it (``policy.random_init`` for ``policy.random_init.hidden_size``:
    a plain dict, replaced whole, as a config file replaces it), None where yours has none."""
    parts = key.split(".")
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        try:
            value = namespace[name]
        except KeyError:
            return name, None
        if not hasattr(value, "as_dict"):  # not a nested Namespace: this setting holds the key
            return name, value
    return key, namespace[key]


def _lookup(tree: dict, key: str) -> Any:
    for part in key.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def _remove_empty_run_dirs(trainer: Any) -> None:
    """A run that failed before it logged anything leaves no ``version_N`` behind: the directory
    (and its lock file beside it) goes if it holds nothing but the config Lightning saved at start
    (config.yaml, hparams.yaml) and empty folders. Anything else in it (metrics, checkpoints, files
    of yours) keeps it."""
    import shutil

    from lldslight.run.run_dir import lock_path, log_dir, previous_run

    for logger in getattr(trainer, "loggers", None) or []:
        path = log_dir(logger)
        if path is not None and not previous_run(path):
            shutil.rmtree(path, ignore_errors=True)
            lock_path(path).unlink(missing_ok=True)  # this process's; the run it locked never was


def _claim_run_dirs(trainer: Any, force: bool, ckpt_path: Any, subcommand: str) -> list:
    """Each logger's run directory checked (no earlier run in it without --force, which replaces
    it; a fit resuming from a checkpoint inside it continues that run, its metrics kept) and locked."""
    from lldslight.run.run_dir import checkpoint_step, claim, keep_metrics, log_dir

    locks: list = []
    try:
        for logger in getattr(trainer, "loggers", None) or []:
            path = log_dir(logger)
            if path is not None:
                ckpt = _checkpoint_file(trainer, ckpt_path)
                lock = claim(path, force, "trainer.logger.init_args.version", ckpt, fit=subcommand == "fit")
                locks.append(lock)
                if lock.continued:
                    keep_metrics(logger, checkpoint_step(ckpt))
    except BaseException:
        for lock in locks:
            lock.release()
        raise
    return locks


def _checkpoint_file(trainer: Any, ckpt_path: Any) -> Optional[Path]:
    """The file ``--ckpt_path`` names, ``last`` resolved as Lightning resolves it (the newest
    ``last*.ckpt`` of the checkpoint callbacks' directories); None for none or a remote one."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lldslight.run.checkpoint_io import CKPT_KEYWORDS

    text = str(ckpt_path)
    if ckpt_path is None or "://" in text or (text in CKPT_KEYWORDS and text != "last") or text.startswith("registry:"):
        return None
    if text == "last":
        found = set()
        for callback in getattr(trainer, "checkpoint_callbacks", None) or []:
            if isinstance(callback, ModelCheckpoint):
                found |= callback._find_last_checkpoints(trainer)
        files = [Path(f) for f in found if Path(f).is_file()]
        return max(files, key=lambda f: f.stat().st_mtime) if files else None
    return Path(text).expanduser()


def _stopped(trainer: Any, subcommand: str) -> Optional[Exception]:
    """The Stopped error (its message and exit status) of a run Lightning stopped on Ctrl-C or SIGTERM."""
    from lldslight.run import stopping
    from lldslight.errors import EXIT_INTERRUPTED, EXIT_TERMINATED, Stopped

    # Lightning's flag is reset when it installs its handlers: one that came while the model loaded
    # is known to lldslight.run.stopping only.
    sigterm = bool(getattr(trainer, "received_sigterm", False)) or stopping.received()
    if trainer is None or not (sigterm or getattr(trainer, "interrupted", False)):
        return None
    what = "SIGTERM" if sigterm else "Ctrl-C"
    code = EXIT_TERMINATED if sigterm else EXIT_INTERRUPTED
    if subcommand != "fit":
        return Stopped(f"stopped by {what} during the evaluation; its report was not written", code)
    ckpt = getattr(getattr(trainer, "checkpoint_callback", None), "last_model_path", "") or ""
    resumed = getattr(trainer, "ckpt_path", None)
    if not ckpt and resumed:  # a resumed run stopped before its first checkpoint: the one it started from stays
        ckpt = str(resumed)
    saved = (f"the last checkpoint is {ckpt} (resume: --ckpt_path last, or --ckpt_path {ckpt})" if ckpt
             else "no checkpoint was written")
    return Stopped(f"stopped by {what} after step {trainer.global_step}; {saved}", code)


TRAINER_DEFAULTS = {
    "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "runs", "name": "lldslight"}},
    # The data module shards prompts per rank itself (groups never straddle ranks, eval keeps every example once).
    "use_distributed_sampler": False,
    "num_sanity_val_steps": 0,
    "log_every_n_steps": 1,
    # Crash-safe checkpoint writes (temp file, fsync, rename): a kill never leaves a corrupt last.ckpt.
    "plugins": [{"class_path": "lldslight.run.checkpoint_io.AtomicCheckpointIO"}],
}


def _quiet_known_warnings() -> None:
    import warnings

    # Manual optimisation checkpoints after the step by design; Lightning's advice does not apply.
    warnings.filterwarnings("ignore", message=".*ModelCheckpoint with manual optimization.*")
    warnings.filterwarnings("ignore", message=".*isinstance.treespec, LeafSpec.*")
    # GRPOModule.on_after_batch_transfer (exact-resume RNG) is meant to run beside the datamodule's hooks.
    warnings.filterwarnings("ignore", message=".*overridden `on_after_batch_transfer` in `LightningModule`.*")
    # peft (PeftModel.__init__) reads transformers' deprecated is_gradient_checkpointing; lldslight does not.
    warnings.filterwarnings("ignore", message=".*`is_gradient_checkpointing` is deprecated.*")
    # Lightning advertises its cloud products ("Tip: ... try installing litlogger / litmodels") on every
    # run; a line that is not about the run.
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NoProductTips) for f in logger.filters):
            logger.addFilter(_NoProductTips())


class _NoProductTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).lstrip().startswith("\U0001f4a1 Tip:")


def _check_config_files(argv: list[str]) -> None:
    """Each ``--config`` (a file or an inline YAML string) checked before jsonargparse reads it: its
    errors name no file, and it has no bounds and keeps a key given twice silently
    (lldslight/run/config_files.py)."""
    from lldslight.run.config_files import check_text, load_file

    pairs = list(zip(argv, argv[1:])) + [tuple(a.split("=", 1)) for a in argv if a.startswith("--config=")]
    configs = []
    for flag, value in pairs:
        if flag not in ("--config", "-c"):
            continue
        if os.path.isfile(value):
            configs.append((value, load_file(value)))
        elif not os.path.isdir(value):
            check_text(value, f"--config {value[:60]!r}")
            configs.append((f"--config {value[:60]!r}", _read_config(value)))
    _check_list_order(configs)
    _check_logger_packages(configs)


# The package each of Lightning's loggers imports when it starts, and the extra of lldslight's that
# installs it (None: not one of lldslight's extras).
LOGGER_PACKAGES = {
    "TensorBoardLogger": (("tensorboard", "tensorboardX"), "tensorboard"),
    "WandbLogger": (("wandb",), "wandb"),
    "MLFlowLogger": (("mlflow",), None),
    "CometLogger": (("comet_ml",), None),
    "NeptuneLogger": (("neptune",), None),
}


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def _check_logger_packages(configs: list[tuple[str, Any]]) -> None:
    """A logger whose package is missing: jsonargparse said "Not a valid subclass of Logger" with a
    dump of the whole namespace. Said in one line naming the package and how to install it."""
    from lldslight.errors import ConfigError

    for name, tree in configs:
        trainer = tree.get("trainer") if isinstance(tree, dict) else None
        if not isinstance(trainer, dict):
            continue
        for key in ("logger", "logger+"):
            entries = trainer.get(key)
            for entry in entries if isinstance(entries, list) else [entries]:
                cls = str(entry.get("class_path", "")).rpartition(".")[2] if isinstance(entry, dict) else ""
                packages, extra = LOGGER_PACKAGES.get(cls, ((), None))
                if packages and not any(_importable(p) for p in packages):
                    how = (f"pip install -e '.[{extra}]' in your lldslight clone, or pip install {packages[0]}" if extra
                           else f"pip install {packages[0]}")
                    raise ConfigError(f"{name}: trainer.{key} {cls} needs the {packages[0]} package, which is not installed: {how}")


def _check_wandb_online(trainer: Any) -> None:
    """An online WandbLogger without an API key, or with its server out of reach, failed at the
    run's first log, after wandb's own retries (22-117 s), in a traceback. Said in one line before
    the model loads: the key is looked up where wandb looks (``wandb.login`` without a prompt and
    without a request), the server is asked once, with a short timeout."""
    import urllib.error
    import urllib.request

    from lightning.pytorch.loggers import WandbLogger

    from lldslight.errors import ConfigError

    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun"):
        return
    # Lightning's WandbLogger keeps offline / mode in private attributes only.
    online = [lg for lg in getattr(trainer, "loggers", None) or [] if isinstance(lg, WandbLogger)
              and not getattr(lg, "_offline", False) and (getattr(lg, "_wandb_init", None) or {}).get("mode") not in ("offline", "disabled")]
    if not online or not trainer.is_global_zero:
        return
    import wandb

    settings = wandb.Settings()  # as wandb.init reads them: its settings files, then the environment
    settings.update_from_system_settings()
    settings.update_from_env_vars(dict(os.environ))
    host = str(settings.base_url)
    where = "trainer.logger WandbLogger (offline: false)"
    if not wandb.login(prompt=False, verify=False, host=host):
        raise ConfigError(f"{where}: no W&B API key for {host}: set WANDB_API_KEY or run `wandb login`, or give the logger "
                          "offline: true (configs/traces.yaml) and upload the run later with `wandb sync`")
    try:
        urllib.request.urlopen(host, timeout=10).close()
    except urllib.error.HTTPError:
        pass  # it answered: reachable
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        raise ConfigError(f"{where}: the W&B server {host} is out of reach ({reason}): check WANDB_BASE_URL and the network, "
                          "or give the logger offline: true and upload the run later with `wandb sync`") from None


LOGGER_FLAG = "--trainer.logger.init_args."


def _flags_to_first_logger(cli: Any) -> None:
    """``--trainer.logger.init_args.KEY VALUE`` with several loggers (a base config's CSV logger and
    ``configs/traces.yaml``'s): jsonargparse gives it to the last logger of the list, so the
    documented ``--trainer.logger.init_args.version NAME`` named the W&B run and the run directory
    kept the base's. It belongs to the first logger, whose directory holds the run and its
    checkpoints: the config is parsed again without those flags (every logger as the files give it)
    and the values, typed by the first parse, are set on the first logger."""
    from lldslight.errors import ConfigError

    sub = cli.config.get("subcommand")
    argv = list(getattr(cli, "argv", None) or [])
    loggers = cli.config[sub].get("trainer", {}).get("logger") if sub else None
    if not isinstance(loggers, list) or len(loggers) < 2 or not any(w.startswith(LOGGER_FLAG) for w in argv):
        return
    rest, keys, words = [], [], iter(argv)
    for word in words:
        if not word.startswith(LOGGER_FLAG):
            rest.append(word)
            continue
        key, eq, _ = word[len(LOGGER_FLAG):].partition("=")
        if not eq:
            next(words, None)
        keys.append(key)
    base = cli.parser.parse_args(rest)
    fixed = base[sub]["trainer"]["logger"]
    first, last = fixed[0], loggers[-1]
    for key in keys:
        if key not in first.init_args:
            raise ConfigError(f"{LOGGER_FLAG}{key}: the first logger, {str(first.class_path).rpartition('.')[2]} (the run's "
                              f"directory), takes no {key!r}; with several loggers these flags set the first one")
        first.init_args[key] = last.init_args[key]
    cli.config[sub]["trainer"]["logger"] = fixed


def _appended_keys(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted keys of a config mapping written ``key+:`` (an append), with what they append."""
    found: dict[str, Any] = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            if isinstance(k, str) and k.endswith("+"):
                found[prefix + k[:-1]] = v
            elif isinstance(v, dict):
                found.update(_appended_keys(v, f"{prefix}{k}."))
    return found


def _check_list_order(configs: list[tuple[str, Any]]) -> None:
    """A list written ``key:`` replaces what the configs before it gave that key, appends included:
    an overlay given before its base (``--config configs/stable.yaml --config configs/tiny.yaml``)
    lost its callbacks silently and kept its other settings (half a drift bound). Refused, naming both."""
    from lldslight.errors import ConfigError

    appended: dict[str, tuple[str, Any]] = {}
    for name, tree in configs:
        for key in _plain_list_keys(tree):
            if key in appended:
                earlier, what = appended[key]
                items = what if isinstance(what, list) else [what]
                shown = ", ".join(str(i.get("class_path", "?")).rpartition(".")[2] if isinstance(i, dict) else repr(i) for i in items)
                leaf = key.rpartition(".")[2]
                raise ConfigError(f"{name}: `{key}:` replaces the {leaf} that {earlier} appended with `{leaf}+:` ({shown}), "
                                  f"which would be dropped while the rest of {earlier} stays; give {name} before {earlier}")
        appended.update({key: (name, value) for key, value in _appended_keys(tree).items()})


def _jsonargparse_one_line(message: str) -> str:
    """jsonargparse explains a bad value inside a class (a typo in a callback's init_args) as every
    alternative of a Union, 15+ lines; keep the path to the first real problem:
    ``trainer.callbacks: lldslight.callbacks.SearchRollout: retriever: ...: Option 'korpus' is not accepted``."""
    lines = [line for line in message.splitlines() if line.strip()]
    start = next((i for i, line in enumerate(lines) if line.strip().startswith("- Problem with given class_path")), None)
    if start is None or "Does not validate against any of the Union subtypes" not in message:
        return " ".join(line.strip() for line in lines)
    key = re.match(r'Parser key "([^"]+)":', lines[0].strip())
    parts = [key.group(1)] if key else []
    depth = len(lines[start]) - len(lines[start].lstrip())
    for i, line in enumerate(lines[start:]):
        if i and len(line) - len(line.lstrip()) <= depth:
            break  # the next alternative of the Union
        text = line.strip().removeprefix("- ")
        found = re.fullmatch(r"Problem with given class_path '([^']+)':|Parser key \"([^\"]+)\":", text)
        if found:
            parts.append(found.group(1) or found.group(2))
        elif not text.startswith(("Does not validate", "Subtypes:", "Errors:")):
            parts.append(text)
            break
    return ": ".join(parts)


def _usage() -> str:
    lines = ["usage: lldslight {fit,validate,test} --config FILE.yaml [...]",
             "       lldslight {" + ",".join(TOOLS) + "} ...", "",
             "  fit / validate / test   train or evaluate (LightningCLI; --help for every option)"]
    lines += [f"  {name:23s} {text}" for name, (_, text) in TOOLS.items()]
    lines += ["", f"  --debug                 show the traceback of a configuration or data error (or {DEBUG_ENV}=1)"]
    return "\n".join(lines) + "\n"


def _run(argv: list[str], from_command_line: bool) -> int:
    _quiet_known_warnings()
    if argv and argv[0] in TOOLS:
        target, _ = TOOLS[argv[0]]
        module_name, fn_name = target.split(":")
        try:
            fn = getattr(importlib.import_module(module_name), fn_name)
        except ModuleNotFoundError as err:
            print(f"lldslight {argv[0]}: not available in this installation ({err})", file=sys.stderr)
            return 2
        return int(fn(argv[1:]) or 0)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    _check_config_files(argv)
    # Like `python -m`, make the working directory importable, so YAML can name your own
    # callbacks and reward functions by class_path (e.g. callbacks.trajectory_table.TrajectoryTable).
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    cli_class, module_cls, datamodule_cls = _cli_class()
    cli_class.argv = list(argv)  # what it parses (LightningCLI keeps no copy): read by _flags_to_first_logger
    cli_class(
        module_cls,
        datamodule_cls,
        # From the command line LightningCLI reads sys.argv itself (and DDP's launcher re-runs it).
        args=None if from_command_line else argv,
        trainer_defaults=TRAINER_DEFAULTS,
        seed_everything_default=0,
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
        # Errors come back as exceptions and are printed once, by main, in one line.
        parser_kwargs={"exit_on_error": False},
    )
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    from_command_line = argv is None
    if from_command_line:
        from lldslight.run.hostmem import reexec_with_malloc_tunables

        reexec_with_malloc_tunables()  # once, before anything is allocated (lldslight/run/hostmem.py)
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = os.environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "yes", "on")
    if "--debug" in argv:
        argv, debug = [a for a in argv if a != "--debug"], True
        if from_command_line:
            sys.argv[1:] = argv  # what LightningCLI and DDP's launcher read
            os.environ[DEBUG_ENV] = "1"  # inherited by DDP's worker processes
    command = argv[0] if argv and not argv[0].startswith("-") else ""

    from jsonargparse import ArgumentError

    from lldslight.errors import EXIT_BROKEN_PIPE, Stopped, UserError

    try:
        code = _run(argv, from_command_line)
        sys.stdout.flush()  # here, so that a reader that left is seen below, not at interpreter exit
        return code
    except BrokenPipeError:
        # The reader of the output left (`lldslight data synth | head`): nothing more to say to it,
        # and nothing to report (a pipe's reader may stop early). Later writes go nowhere.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except Stopped as stop:
        print(f"lldslight{' ' + command if command else ''}: {stop}", file=sys.stderr)
        return stop.code
    except (UserError, ArgumentError) as err:
        if debug:  # the traceback, then the same line and exit status as without --debug
            traceback.print_exc()
        message = _jsonargparse_one_line(str(err)) if isinstance(err, ArgumentError) else str(err)
        print(f"lldslight{' ' + command if command else ''}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
