"""What the rules know: the run's fixed structure (:class:`RunFacts`), what one step says (:class:`View`),
and what the rule families share between steps (:class:`Memory`).

Structure comes from the schema alone (names, shapes, the module tree and its types, the optimizer's
class), so the rules can reason about *where* without torch: which parameters are weight matrices and
their fan-in (an init-scale check needs no history), which belong to embeddings (N(0, 1) by design), which
are recurrent matrices (named as such when a recurrent net explodes), which modules normalise (a
degenerate batch divides by zero there), and the forward order of modules (from the backward order the
trainer records on the first step).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from gradwatch.diagnose.stats import finite
from gradwatch.protocol import Schema, Step

EMBEDDINGS = frozenset({"Embedding", "EmbeddingBag"})
RECURRENT = frozenset({"RNN", "GRU", "LSTM", "RNNCell", "GRUCell", "LSTMCell"})
#: torch.nn's own normalisations: every one has an epsilon, so a constant batch cannot make them divide by 0.
SAFE_NORMS = frozenset({"BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm", "LayerNorm", "GroupNorm",
                        "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d", "LocalResponseNorm", "RMSNorm",
                        "LazyBatchNorm1d", "LazyBatchNorm2d", "LazyBatchNorm3d"})
_NORM_WORDS = ("norm", "standard", "whiten", "zscore", "scale")
_ADAPTIVE = ("adam", "rmsprop", "adagrad", "adadelta", "adafactor", "lion", "lamb", "sophia", "adan", "shampoo")


class RunFacts:
    """The fixed structure of one run, derived from its schema."""

    def __init__(self, schema: Schema, backward_order: Iterable[int] | None = None) -> None:
        self.schema = schema
        self.n = schema.n
        self.names = [p.name for p in schema.params]
        self.modules = schema.modules
        shapes = [tuple(p.shape) for p in schema.params]
        self.numel = np.array([max(1, p.numel) for p in schema.params], dtype=np.float64)
        self.is_matrix = np.array([len(s) >= 2 for s in shapes], dtype=bool)
        self.fan_in = np.array([float(math.prod(s[1:])) if len(s) >= 2 else 1.0 for s in shapes])
        self.module_of = np.array([p.module if 0 <= p.module < len(self.modules) else -1 for p in schema.params],
                                  dtype=np.int64)
        types = [self.modules[m].type if m >= 0 else "" for m in self.module_of]
        self.embedding = np.array([t in EMBEDDINGS for t in types], dtype=bool)
        self.recurrent = np.array([t in RECURRENT and "weight_hh" in name for t, name in zip(types, self.names)],
                                  dtype=bool)
        opt = schema.optimizer.lower()
        self.adaptive = any(word in opt for word in _ADAPTIVE)
        self.sgd = not self.adaptive and "sgd" in opt
        self.optimizer = schema.optimizer or "the optimizer"
        #: Weight matrices whose gradient-to-weight ratio means something: not embeddings (sparse rows).
        self.judged = self.is_matrix & ~self.embedding & (self.numel >= 16)
        self.none = np.zeros(self.n, dtype=bool)  # shared read-only "no parameter" mask and index list
        self.none.flags.writeable = False
        self.empty = np.zeros(0, dtype=np.int64)
        self.set_backward_order(backward_order)
        self.detached: list[int] = []

    def set_detached(self, idx: Iterable[int]) -> None:
        """Parameters whose module ran its forward without autograd after a learning one, in run order."""
        self.detached = [int(i) for i in idx if 0 <= int(i) < self.n]

    def set_backward_order(self, order: Iterable[int] | None) -> None:
        idx = [int(i) for i in order] if order is not None else []
        if sorted(idx) != list(range(self.n)):
            idx = list(range(self.n - 1, -1, -1))  # default: backward visits the last layers first
        self.bw_pos = np.empty(self.n, dtype=np.int64)
        self.bw_pos[np.array(idx, dtype=np.int64)] = np.arange(self.n)

    def forward_first(self, idx: Iterable[int]) -> int:
        """Of these parameters, the one earliest in forward order (latest in backward order)."""
        idx = list(idx)
        return int(max(idx, key=lambda i: (self.bw_pos[i], -i)))

    def backward_first(self, idx: Iterable[int]) -> int:
        """Of these parameters, the one earliest in backward order (where a NaN entered backward)."""
        idx = list(idx)
        return int(min(idx, key=lambda i: (self.bw_pos[i], i)))

    def module_name(self, m: int) -> str:
        return (self.modules[m].name or "(root)") if 0 <= m < len(self.modules) else "?"

    def owner(self, i: int) -> str:
        """The module that owns parameter ``i``, as ``name (Type)``."""
        m = int(self.module_of[i])
        if m < 0:
            return self.names[i].rsplit(".", 1)[0]
        return f"{self.module_name(m)} ({self.modules[m].type})"

    def params_by_module(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for i, m in enumerate(self.module_of):
            out.setdefault(int(m), []).append(i)
        return out

    def first_module(self) -> int | None:
        """The module that runs first in forward order (of those with parameters), by the backward order."""
        if not self.n:
            return None
        m = int(self.module_of[self.forward_first(range(self.n))])
        return m if m >= 0 else None

    def dividing_module(self) -> int | None:
        """The module most likely to divide by a batch's spread: the first custom module (not one of
        torch.nn's, which all have an epsilon) whose type or name says it normalises; else None."""
        for m, info in enumerate(self.modules):
            if info.type in SAFE_NORMS or info.parent < 0:
                continue
            text = f"{info.type} {info.name.rsplit('.', 1)[-1]}".lower()
            if any(w in text for w in _NORM_WORDS):
                return m
        return None


@dataclass(slots=True)
class View:
    """One step, decoded once for every rule."""

    s: Step
    step: int
    loss: float | None  # finite loss, else None
    total: float | None  # finite total gradient norm, else None
    gn: np.ndarray  # per-parameter gradient norm (float64)
    nograd: np.ndarray  # bool: no gradient at this step
    bad: np.ndarray  # indices with a non-finite gradient
    wn: np.ndarray | None  # weight norms measured at this step
    wbad: np.ndarray | None  # indices with non-finite weights, if the weights were checked at this step
    lr: float | None
    eps: float | None  # the first parameter group's eps (Adam & co), on steps that carry the hyper-parameters
    full: bool  # the per-layer rules run at this step


@dataclass(slots=True)
class Memory:
    """What rule families share across steps."""

    steps: int = 0
    wn: np.ndarray | None = None  # the last measured weight norms...
    wn_step: int = -1  # ...and their step
    init_scale: np.ndarray | None = None  # rms(w) * sqrt(fan_in) at the first measurement (1/sqrt(3) is default init)
    first_losses: list[float] = field(default_factory=list)
    _start: float | None = None  # start_loss(), once the first three losses are in
    smooth_loss: float | None = None
    hist_steps: list[int] = field(default_factory=list)  # steps and smoothed losses, for "not improving"
    hist_smooth: list[float] = field(default_factory=list)
    min_smooth: float | None = None
    prev_loss: float | None = None
    prev_total: float | None = None
    grads_applied_bad: bool = False  # the previous step's non-finite gradients reached optimizer.step()
    weights_bad: bool = False  # the last check found non-finite weights
    explosion: tuple[int, str | None] | None = None  # (step, layer) of the last explosion alert
    spike: tuple[int, str | None] | None = None  # (step, layer) of the last gradient-spike alert
    ratios: list[tuple[int, float]] = field(default_factory=list)  # (step, whole-model update ratio)
    last_ratio: tuple[int, float] | None = None
    collapse_step: int | None = None  # the step the total gradient norm fell >= 1000x in one step
    scaled: bool = False  # a GradScaler is in use
    clipping: bool = False  # clipping was measured active
    last_grad_spike: int | None = None
    big_update: tuple[int, float] | None = None  # one huge update, held to see whether saturation follows
    last_loss_spike: int | None = None
    #: The adaptive optimizer's eps, from the last step that carried the hyper-parameters (detail steps);
    #: torch's default for Adam, AdamW and RMSprop until one does.
    eps: float = 1e-8

    def start_loss(self) -> float | None:
        """The median of the first three finite losses: where training started."""
        if self._start is not None:
            return self._start
        f = self.first_losses
        if not f:
            return None
        if len(f) == 3:
            self._start = sorted(f)[1]
            return self._start
        return f[0] if len(f) == 1 else 0.5 * (f[0] + f[1])

    def note_loss(self, step: int, loss: float | None) -> None:
        if loss is None:
            return
        if len(self.first_losses) < 3:
            self.first_losses.append(loss)
        self.smooth_loss = loss if self.smooth_loss is None else self.smooth_loss + 0.1 * (loss - self.smooth_loss)
        if self.steps >= 10:
            self.min_smooth = self.smooth_loss if self.min_smooth is None else min(self.min_smooth, self.smooth_loss)
        self.hist_steps.append(step)
        self.hist_smooth.append(self.smooth_loss)
        if len(self.hist_steps) > 256:  # keep the last ~128 steps of history (the windows are <= 100)
            del self.hist_steps[:128], self.hist_smooth[:128]

    def stuck(self, window: int, fraction: float) -> bool:
        """The smoothed loss has not improved over the last ``window`` steps and is still above ``fraction``
        of where it started: not learning (a plateau after real progress is not stuck)."""
        start = self.start_loss()
        if start is None or self.smooth_loss is None or not self.hist_steps:
            return False
        now = self.hist_steps[-1]
        if now - self.hist_steps[0] < window:
            return False
        old = self.hist_smooth[bisect.bisect_left(self.hist_steps, now - window)]
        return self.smooth_loss >= 0.95 * old and self.smooth_loss >= fraction * start


def decode(s: Step, facts: RunFacts, full: bool) -> View | None:
    """The :class:`View` of a step, or None if it does not fit the schema."""
    n = facts.n
    gn = np.frombuffer(s.grad_norm, dtype=np.float32).astype(np.float64) if n else np.zeros(0)
    if len(gn) != n:
        return None
    if s.nograd:
        nograd = np.zeros(n, dtype=bool)
        for i in s.nograd:
            if 0 <= i < n:
                nograd[i] = True
    else:
        nograd = facts.none
    bad = np.array(sorted(i for i in s.nonfinite if 0 <= i < n), dtype=np.int64) if s.nonfinite else facts.empty
    wn = None
    if s.weight_norm is not None:
        w = np.frombuffer(s.weight_norm, dtype=np.float32).astype(np.float64)
        wn = w if len(w) == n else None
    wbad = None
    if s.weight_nonfinite is not None:
        wbad = np.array(sorted(i for i in s.weight_nonfinite if 0 <= i < n), dtype=np.int64)
    elif wn is not None:
        wbad = np.flatnonzero(~np.isfinite(wn))  # an older trainer: the L2 norms are the check
    lr = s.opt[0].get("lr") if s.opt else None
    eps = s.opt[0].get("eps") if s.opt else None
    return View(s=s, step=s.step, loss=s.loss if finite(s.loss) else None, total=s.total if finite(s.total) else None,
                gn=gn, nograd=nograd, bad=bad, wn=wn, wbad=wbad, lr=float(lr) if finite(lr) else None,
                eps=float(eps) if finite(eps) and eps > 0 else None, full=full)


def gradient_to_weight(v: View, facts: RunFacts, memory: Memory) -> np.ndarray:
    """||g|| / ||w|| per judged weight matrix (NaN elsewhere), against the latest weight norms. Weights
    that are (nearly) zero -- a zero-initialised output layer -- are not judged: any gradient is large there."""
    out = np.full(facts.n, np.nan)
    wn = v.wn if v.wn is not None else memory.wn
    if wn is None:
        return out
    with np.errstate(all="ignore"):
        scale = wn / np.sqrt(facts.numel) * np.sqrt(facts.fan_in)
        ok = facts.judged & np.isfinite(wn) & (scale >= 0.1) & np.isfinite(v.gn) & ~v.nograd
        out[ok] = v.gn[ok] / wn[ok]
    return out
