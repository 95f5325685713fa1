"""Diagnosis: alert rules over step records that say *where* and *why*, early, with few false alarms.

Pure Python and numpy: no torch, no Textual. The package is cut by rule family:

* :mod:`.vocabulary` -- the alert kinds (the README's table is generated from them), causes, :class:`Alert`;
* :mod:`.facts` -- what the rules know about the run (structure from the schema) and about one step;
* :mod:`.nonfinite` -- NaN/Inf in data, weights, activations, the loss and the gradients, with attribution;
* :mod:`.explosion` -- explosions (also from step 0, without history) and spikes;
* :mod:`.dynamics` -- saturation, vanishing gradients, dead layers;
* :mod:`.rates` -- learning rates far too high, warm-ups that climb too far;
* :mod:`.data` -- unnormalised inputs, degenerate batches, targets that do not fit the loss;
* :mod:`.training` -- mixed-precision overflow streaks, clipping under Adam;
* :mod:`.advice` -- advice fitted to the run; :mod:`.stats` -- running statistics and episodes;
* :mod:`.engine` -- the :class:`Diagnoser` that runs them all.

Every alert is structured: a stable ``kind``, a ``severity``, the ``step``, the ``rank``, the ``layer``
the evidence points to, the ``evidence`` itself (the numbers, and what chose the layer), ranked
``causes`` and ``advice`` for this run, including what will *not* help.
"""

from gradwatch.diagnose.engine import Diagnoser
from gradwatch.diagnose.thresholds import Thresholds
from gradwatch.diagnose.vocabulary import CAUSES, KINDS, SEVERITIES, Alert, Kind, kinds_table

__all__ = ["CAUSES", "KINDS", "SEVERITIES", "Alert", "Diagnoser", "Kind", "Thresholds", "kinds_table"]
