"""What the first step teaches the diagnosis, once: the backward order and the modules run without autograd.

* **Backward order** (a tensor hook on each parameter for the first backward: it runs when the
  parameter's gradient arrives, just before it is accumulated): "the first parameter to go non-finite
  in backward order" is where a NaN entered backward.
* **Detached modules** (forward hooks on the modules that own trainable parameters, first forward only):
  a module that runs its forward with autograd off (``torch.no_grad()``, ``inference_mode``) *after* a
  module whose parameters do get a gradient is a branch cut from the graph in the middle of the network
  -- its output joins the rest, but its parameters never get a gradient and never train (a
  "memory-saving" ``no_grad`` around an attention branch). A frozen backbone run under ``no_grad`` at
  the input is not one: nothing trainable runs before it. A module whose output is merely unused (a
  pooler) runs *with* autograd and is not one either.

Every hook is removed at the first boundary (:meth:`FirstStep.take`), so later steps pay nothing --
except under ``torch.compile``, where removing them would recompile the model (docs/design.md, Torch 9).
"Nothing" needs more than ``handle.remove()`` for the backward hooks (docs/design.md, Torch 10): a removed
hook leaves the tensor's hook dict empty but still wired into autograd, which calls it with the GIL on every
backward for the rest of the run (+20 us a step on the tutorial MLP's 24 parameters). Only a tensor hook
can be unwired -- assigning None to ``_backward_hooks`` clears it -- so these are tensor hooks, not
post-accumulate-grad hooks, and :meth:`drop` unwires every dict it emptied that was not there before.
"""

from __future__ import annotations

from typing import Any

import torch


class FirstStep:
    """The hooks of the first step and what they saw."""

    def __init__(self) -> None:
        self.hooks: list[Any] = []
        self._wired: list[torch.Tensor] = []  # parameters whose hook dict we created (unwired by drop)
        self.bw_order: list[int] = []
        #: (parameter indices owned by the module, autograd on), in the order the modules first ran
        self.fw_runs: list[tuple[list[int], bool]] = []
        self._fw_hooks: list[Any] = []
        self._owners: dict[int, list[int]] = {}
        self.compiled = False  # the first forward ran compiled: its forward hooks are kept (see take)

    @property
    def pending(self) -> bool:
        return bool(self.hooks)

    def learn(self, model: Any, params: list[torch.nn.Parameter]) -> None:
        """Attach the hooks (never raises: without them the diagnosis falls back to the defaults)."""
        try:
            self._backward(params)
            if isinstance(model, torch.nn.Module):
                self._forward(model, params)
        except Exception:  # noqa: BLE001
            self.drop()

    def _backward(self, params: list[torch.nn.Parameter]) -> None:
        order = self.bw_order
        for i, p in enumerate(params):
            if p._backward_hooks is None:
                self._wired.append(p)
            self.hooks.append(p.register_hook(lambda _g, i=i: order.append(i)))  # returns None: grad unchanged

    def _forward(self, model: torch.nn.Module, params: list[torch.nn.Parameter]) -> None:
        index = {id(p): i for i, p in enumerate(params)}
        runs, owners = self.fw_runs, self._owners
        compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or (lambda: False)
        for mod in model.modules():
            own = [index[id(p)] for p in mod.parameters(recurse=False) if id(p) in index]
            if not own:
                continue
            owners[id(mod)] = own

            def hook(m: Any, _inp: Any, _out: Any) -> None:
                if compiling():
                    return  # traced as a constant: nothing in the graph
                try:  # inside the user's forward: never raise
                    own = owners.pop(id(m), None)  # each module once
                    if own is not None:
                        runs.append((own, torch.is_grad_enabled()))
                except Exception:  # noqa: BLE001
                    pass

            self._fw_hooks.append(mod.register_forward_hook(hook))
        self.hooks += self._fw_hooks

    def take(self, meta: dict[str, Any], params: list[torch.nn.Parameter]) -> None:
        """At the first boundary: drop the hooks, put what they saw into the step's ``meta``. A compiled
        forward (``torch.compile``) showed the forward hooks nothing (:attr:`compiled`); dynamo guards on
        the length of each module's hook dict, so removing them would recompile the model: they stay (no-ops
        in the graph) until the watcher closes, and no hook may be added to those modules either
        (act_plan.py: activation statistics are then refused with the reason, not a recompile)."""
        if self.fw_runs or not self._fw_hooks:
            self.drop()
        else:
            self.compiled = True
            self._owners.clear()
            self.drop(keep=self._fw_hooks)
        seen: set[int] = set()
        meta["backward_order"] = [i for i in self.bw_order if not (i in seen or seen.add(i))]
        detached: list[int] = []
        learning_before = False
        for own, grad_on in self.fw_runs:
            if not grad_on and learning_before:
                detached += [i for i in own if params[i].grad is None]
            learning_before = learning_before or (grad_on and any(params[i].grad is not None for i in own))
        if detached:
            meta["detached"] = detached  # in the order their modules ran

    def drop(self, keep: list[Any] | None = None) -> None:
        """Remove the hooks (but those in ``keep``: they stay until :meth:`close`)."""
        for h in self.hooks:
            if keep is not None and h in keep:
                continue
            try:
                h.remove()
            except Exception:  # noqa: BLE001
                pass
        self.hooks.clear()
        wired, self._wired = self._wired, []
        for p in wired:
            try:
                if p._backward_hooks is not None and not p._backward_hooks:  # emptied, and not someone else's
                    p._backward_hooks = None  # unwires it from autograd (the module docstring)
            except Exception:  # noqa: BLE001
                pass

    def close(self) -> None:
        """The watcher closes: every hook goes, the kept forward hooks too."""
        self.drop()
        self.hooks, self._fw_hooks = self._fw_hooks, []
        self.drop()
