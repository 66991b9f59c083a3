"""How every logged metric is reduced: across ranks, and over the updates of one step; one table.

A step's metric is combined along up to three axes, and each site that combines reads its rule here:

- **over micro-batches** (update/train.py, ``update``): a micro-batch records its *share* of a
  mini-batch value (a sum over its rows divided by a mini-batch total) or a count, so the shares
  of one update's micro-batches add up, except maxima; the rows of a mini-batch are split over
  micro-batches and over ranks alike, so this is the across-ranks rule of those keys;
- **over the updates of a step** (update/train.py, ``RolloutUpdates.step_metrics``): :func:`over_updates`;
- **across ranks** (DDP, FSDP2): :func:`reduction`, read by ``GRPOModule._log_step``, LLDMonitor
  and SearchRollout.

A rule names a key exactly or by a glob (``*`` matches anything, ``/`` included); the first rule
that matches wins (:data:`RULES`, in that order). The reductions:

- ``"sum"``: each rank holds a part of the value (a share of a mini-batch value, a count of its
  own rows or queries); the global value is the sum;
- ``"max"``: a maximum (``*_max``), a flag raised by any rank, or a time (a step takes as long as
  its slowest rank);
- ``"mean"``: everything else: a per-rank mean over equally many rows (the step's rollout
  statistics, averaged), a true ratio whose numerator and denominator are summed over ranks before
  dividing (``lld/*``, ``diag/*``: LLDMonitor), or a value already the same on every rank (the
  learning rate, the gradient norm, the guard's decisions, the alarm, evaluation's gathered
  numbers), for which the mean changes nothing;
- ``"min"``: the smallest over ranks (no metric uses it today).

An update's metric no rule names (your loss term's or step gate's key) follows its channel
(update/train.py): a loss term records a share or a count, summed; a step gate a value every rank
shares, averaged. Anywhere else a key without a rule is a bug (:func:`reduction` raises KeyError;
tests/test_metric_rules.py checks every key docs/metrics.md and the source name, tests/test_docs.py
every key a real run logs). docs/metrics.md, "How metrics are reduced across ranks", is this table
in words. One key breaks its rule: ``time/lld_monitor_s`` is logged as the logging rank's own time
(LLDMonitor does not reduce it).

No torch here: the sites do the collectives (distributed.reduce_over_ranks, Lightning's
``reduce_fx``), this module only says which.
"""
from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase
from functools import lru_cache
from typing import Literal, Optional

Reduction = Literal["sum", "max", "mean", "min"]
REDUCTIONS: tuple[Reduction, ...] = ("sum", "max", "mean", "min")


@dataclass(frozen=True)
class Rule:
    pattern: str  # a key, or a glob over keys (fnmatch: `*` matches anything, `/` included)
    ranks: Reduction  # across ranks
    updates: Optional[Reduction]  # over the updates of a step; None: logged once per step, not per update
    why: str


RULES: tuple[Rule, ...] = (
    # -- maxima, first: they win over every rule below (a loss term's "x_max" too) -----------------------
    Rule("*_max", "max", "max", "a maximum stays a maximum"),
    Rule("time/*", "max", None, "a step takes as long as its slowest rank"),
    Rule("retrieval/breaker_open", "max", None, "1 when any rank's circuit breaker was open"),
    # -- an update's shares of a mini-batch value, and counts (update/train.py: RolloutUpdates.summed) -------
    Rule("train/loss", "sum", "mean", "this rank's share of the mini-batch loss"),
    Rule("train/pg_loss", "sum", "mean", "share of the policy loss"),
    Rule("train/kl", "sum", "mean", "share of the KL estimate"),
    Rule("train/clip_frac", "sum", "mean", "share of the mini-batch's tokens that were clipped"),
    Rule("train/entropy", "sum", "mean", "share of the mini-batch's token-mean entropy"),
    Rule("train/nonfinite*", "sum", "sum", "counts of dropped tokens and skipped micro-batches, added up"),
    Rule("rollout/logp_mismatch", "sum", "mean", "share of the on-policy mini-batch's token mean"),
    Rule("rollout/logp_mismatch_kl", "sum", "mean", "share of the on-policy mini-batch's token mean"),
    Rule("llds/loss", "sum", "mean", "LLDS's loss term: a share"),
    Rule("llds/active_actions", "sum", "mean", "a count per mini-batch"),
    Rule("llds/active_tokens", "sum", "mean", "a count per mini-batch"),
    # -- drift of a rollout batch's updates (update/train.py: drift_shares, the drift bound; AdaptiveRate) ----
    Rule("drift/updates", "mean", "mean", "updates applied this step: ranks decide the drift bound alike"),
    Rule("drift/stopped", "mean", "mean", "1 when the drift bound stopped the step's updates: the same on every rank"),
    Rule("drift/signal", "mean", "mean", "1 when the step's drift measures its updates: ranks share it"),
    Rule("drift/lr_scale", "mean", None, "AdaptiveRate's factor on the schedule: the same on every rank"),
    Rule("drift/target_kl", "mean", None, "AdaptiveRate's target: the same on every rank"),
    Rule("drift/rate_*", "mean", None, "AdaptiveRate's controller state (error, integral, held count): the same on every rank"),
    Rule("drift/*", "sum", "mean", "shares of a mini-batch token mean (and the last update's), added up over ranks"),
    # -- an update's values that every rank shares (update/train.py: RolloutUpdates.shared) ------------------
    Rule("train/grad_norm", "mean", "mean", "the global norm, the same on every rank"),
    Rule("train/vetoed_updates", "mean", "sum", "ranks agree on every veto; a step's vetoes add up"),
    Rule("train/skipped_updates", "mean", "sum", "the norm is global, so ranks skip alike; a step's skips add up"),
    Rule("guard/*", "mean", "mean", "the guard decides from the global norm, the same on every rank"),
    # -- once per step, counts that add up over ranks ---------------------------------------------------
    Rule("retrieval/unavailable", "sum", None, "queries of every rank"),
    Rule("retrieval/short_circuited", "sum", None, "queries of every rank"),
    Rule("rollout/kept_groups", "sum", None, "groups of every rank"),
    Rule("rollout/dropped_groups", "sum", None, "groups of every rank"),
    # -- once per step, means -----------------------------------------------------------------------------
    Rule("rollout/rounds", "mean", None, "ranks sample the same number of rounds"),
    Rule("rollout/filled", "mean", None, "ranks agree on it"),
    Rule("train/reward", "mean", None, "mean over this rank's rollouts; ranks hold equally many"),
    Rule("train/em", "mean", None, "as train/reward"),
    Rule("train/searches", "mean", None, "as train/reward"),
    Rule("train/response_len", "mean", None, "as train/reward"),
    Rule("train/valid_action_rate", "mean", None, "as train/reward"),
    Rule("train/answered_rate", "mean", None, "as train/reward"),
    Rule("train/zero_var_groups", "mean", None, "share of this rank's groups; ranks hold equally many"),
    Rule("train/lr", "mean", None, "the same on every rank"),
    Rule("llds/beta", "mean", None, "from V of the whole rollout batch: the same on every rank"),
    Rule("lld/*", "mean", None, "true ratios: numerator and denominator summed over ranks before dividing (LLDMonitor)"),
    Rule("diag/*", "mean", None, "true ratios, as lld/*"),
    # -- computed from values already global (the same on every rank), not reduced again ----------------
    Rule("alarm/*", "mean", None, "from the reduced step metrics"),
    Rule("signal/*", "mean", None, "GroupSignal: from the reduced step metrics"),
    Rule("sync/*", "mean", None, "the weight-sync probe: the same weights, so the same value, on every rank"),
    Rule("heal/*", "mean", None, "the same decision on every rank"),
    Rule("probe/*", "mean", None, "the same probe on every rank (rank 0 writes it)"),
    Rule("val/*", "mean", None, "records gathered over ranks before the summary"),
    Rule("test/*", "mean", None, "as val/*"),
    Rule("val_before/*", "mean", None, "as val/*"),
    Rule("val_after/*", "mean", None, "as val/*"),
    Rule("sft/*", "mean", None, "the warm start's loss, as Lightning's default"),
)


@lru_cache(maxsize=4096)
def rule_for(key: str) -> Optional[Rule]:
    """The first rule of :data:`RULES` that names ``key``, or None."""
    return next((r for r in RULES if r.pattern == key or fnmatchcase(key, r.pattern)), None)


def reduction(key: str, default: Optional[Reduction] = None) -> Reduction:
    """How ``key`` is reduced across ranks. A key no rule names gets ``default`` (an update's
    metrics: by channel, see the module docstring), or raises KeyError without one."""
    rule = rule_for(key)
    if rule is not None:
        return rule.ranks
    if default is None:
        raise KeyError(f"metric {key!r} has no reduction rule: add one to lldslight/run/metric_rules.py (and its row to docs/metrics.md)")
    return default


def over_updates(key: str) -> Reduction:
    """How ``key``, recorded once per update, is combined over the updates of a step: its rule's,
    else the mean (over the updates that recorded it)."""
    rule = rule_for(key)
    return rule.updates if rule is not None and rule.updates is not None else "mean"


def logged_name(key: str) -> str:
    """The logged name of a key an update records: ``train/<key>``, unless the key names its own
    namespace (``llds/loss``, ``guard/vetoed``)."""
    return key if "/" in key else f"train/{key}"
