"""Every threshold of every rule, in one place, with defaults chosen to be quiet on healthy training.

Checked against healthy runs of 2,000 steps (MLPs under Adam and SGD, a batch-norm conv net under SGD +
momentum, GRU and LSTM nets, an AdamW transformer with warm-up and cosine decay, a loss that converges to
~0, float16 autocast with a GradScaler, bf16 autocast, clipping active on most steps): the margins are in
``docs/diagnosis.md``. Pass your own with ``gradwatch.watch(diagnose=Thresholds(...))`` or a dict.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, slots=True)
class Thresholds:
    warmup: int = 30  # steps of statistics before a spike can be called
    spike_z: float = 8.0  # robust z-score (log10 domain) of a spike...
    loss_spike_ratio: float = 3.0  # ...and the loss at least this many times its running level
    grad_spike_ratio: float = 10.0  # ...and a gradient norm at least this many times its running level
    layer_spike_z: float = 10.0
    loss_floor: float = 1e-6  # a loss below this fraction of the largest level it had is at the rounding floor
    # (float32 resolves ~1.2e-7 of a value): its jitter, and the gradients it leaves, are not spikes
    explode_gw: float = 40.0  # a weight matrix's ||g|| / ||w|| this large in the first `warmup` steps is an
    # explosion (healthy runs: up to 17, on the article's MLP with its x10 "risky activation"; failing: 87+)
    init_scale: float = 5.0  # rms(w) * sqrt(fan_in) this large is a bad init (default init ~0.58, He ~1.4)
    explode_jump: float = 1e3  # one step's growth of the total gradient norm that is an explosion by itself
    explode_early_jump: float = 10.0  # ...or in the first `warmup` steps, while the loss at least doubles
    explode_growth: float = 2.0  # per-step growth, sustained for explode_steps steps...
    explode_steps: int = 4
    explode_total: float = 16.0  # ...and this much in all (x2 for 4 steps)
    explode_floor: float = 1e2  # total norms below this are not called exploding by the growth rules
    dead_steps: int = 20  # consecutive steps of exactly-zero gradient (layer: dead; total: saturated)
    vanish_factor: float = 1e-4  # total norm below this fraction of its early level (or first layer vs best)...
    vanish_steps: int = 30  # ...for this many steps, while the loss did not improve
    adaptive_eps: float = 10.0  # under Adam & co a layer is starved only below this many times the optimizer's
    # eps per element: its update is g / (sqrt(v) + eps), so a small gradient is rescaled, not lost
    update_ratio: float = 0.02  # whole-model update ratio: the median over update_ratio_steps steps above this...
    update_ratio_window: int = 3  # ...of at least this many measurements...
    update_ratio_steps: int = 50
    stuck_fraction: float = 0.7  # ...while the smoothed loss is still above this fraction of its start, or has
    rise_steps: int = 20  # ...stayed warmup_loss_rise above its best for this many steps
    update_ratio_extreme: float = 0.3  # one update above this, and the loss did not fall after it
    warmup_lr_growth: float = 1.5  # LR grew by this factor over warmup_window steps...
    warmup_window: int = 50
    warmup_loss_rise: float = 1.3  # ...while the smoothed loss rose this far above its minimum
    amp_skips: int = 5  # consecutive skipped optimizer steps (a few at start-up are the scaler calibrating)
    input_abs: float = 1e3  # float inputs (or targets) with |x| above this...
    input_std: float = 20.0  # ...or a std above this...
    input_mean: float = 20.0  # ...or |mean| above this are not normalised
    target_z: float = 20.0
    rearm: int = 50  # steps a condition must be seen false before an alert of the same kind and layer fires again
    layer_every: int = 4  # per-layer statistics every this many steps (and on trouble and detail steps)
