"""What is refused before a run starts, each in one line naming the file or key: ``--config`` files
read safely, the old flat model keys, overlays given before their base, a logger whose package is
missing or whose W&B server is out of reach; and ``--trainer.logger.init_args.*`` given to the
first logger, whose directory holds the run.
"""
from __future__ import annotations

import importlib
import os
import re
from typing import Any, Iterator


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


def _refuse_flat_keys(model: Any, where: str) -> None:
    """One line naming the new place of each flat model key (``model.lr``: now ``model.optim.lr``)
    that ``model`` (a config's ``model:`` mapping, or the keys after ``--model.``) holds, before the
    parse and the model (lldslight/run/deprecated_keys.py)."""
    from lldslight.run import deprecated_keys
    from lldslight.errors import ConfigError

    found = deprecated_keys.flat_keys_in(model) if isinstance(model, dict) else [k for k in model or () if k in deprecated_keys.GROUP_OF]
    if found:
        raise ConfigError(where + deprecated_keys.moved(found))


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
    _check_moved_class_paths(configs, argv)


def _check_moved_class_paths(configs: list[tuple[str, Any]], argv: list[str]) -> None:
    """A class path naming a module that moved into a folder (lldslight.distributed.FSDP2Strategy):
    jsonargparse said "module 'lldslight' has no attribute ..." with every alternative of the
    strategy's Union. Said in one line naming the new place (lldslight/run/deprecated_keys.py)."""
    from lldslight.errors import ConfigError
    from lldslight.run import deprecated_keys

    def strings(tree: Any, key: str) -> Iterator[tuple[str, str]]:
        if isinstance(tree, dict):
            for k, v in tree.items():
                yield from strings(v, f"{key}.{k}" if key else str(k))
        elif isinstance(tree, list):
            for v in tree:
                yield from strings(v, key)
        elif isinstance(tree, str):
            yield key, tree

    found = [(f"{name}: {key}", text) for name, tree in configs for key, text in strings(tree, "")]
    found += [("the command line", word) for word in argv]
    for where, text in found:
        for path in re.findall(r"lldslight(?:\.\w+)+", text):
            line = deprecated_keys.moved_class_path(path)
            if line:
                raise ConfigError(f"{where}: {line}")


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
