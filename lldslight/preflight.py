"""Checks that run before the policy's weights load, so a bad path, corpus, URL or checkpoint fails
in a second with one line instead of minutes later under a traceback.

Lightning calls the setup hooks after ``prepare_data`` (which writes the synthetic knowledge base)
and before ``configure_model`` (which loads the policy): the datamodule's ``setup`` reads and
validates every question file, ``SearchRollout.setup`` calls :func:`check_retriever` and
``GRPOModule.setup`` calls :func:`check_policy` and :func:`check_checkpoint`. The CLI checks
``--ckpt_path`` even earlier, before LightningCLI reads the checkpoint's hyper-parameters.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any


# --------------------------------------------------------------------------- model


def check_policy(cfg: Any) -> None:
    """Find the policy's weights and tokenizer (demo package, GGUF, directory or hub id) without
    loading them. A demo GGUF is de-quantised into its cache here (once), as loading would."""
    from lldslight.policy import DEMO_MODELS, PolicyLoadError, check_hub_model, check_layers, model_config, resolve_model_dir

    model_dir = resolve_model_dir(cfg, weights=False)
    if Path(model_dir).is_dir():  # a local directory (a hub id's config is read when it loads)
        check_layers(cfg, model_config(cfg, model_dir))
    resolve_model_dir(cfg)  # now the weight files
    tok = getattr(cfg, "tokenizer", None)
    if tok and tok not in DEMO_MODELS and not Path(tok).expanduser().exists():
        if "/" not in tok or tok.startswith((".", "/", "~")):
            raise PolicyLoadError(f"policy.tokenizer {tok!r} is neither a demo model, nor an existing path, nor a hub id")
        check_hub_model(tok, what="tokenizer")
