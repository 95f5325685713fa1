"""What the framework adapters take from a batch and a loss, including batches that misbehave: the
adapters run inside the framework's hooks, where an exception would stop the training."""

from __future__ import annotations

from collections import UserDict
from typing import Any

import torch

from gradwatch.integrations._common import LossSum, split_batch, wrap_method


class Hostile:
    @property
    def keys(self) -> Any:
        raise RuntimeError("no keys for you")


class BadMapping(UserDict):
    def __getitem__(self, key: Any) -> Any:
        raise KeyError(key)

    def __contains__(self, key: object) -> bool:
        return True


def test_split_batch_shapes_and_hostile_batches() -> None:
    x, y = torch.randn(2, 3), torch.tensor([0, 1])
    assert split_batch((x, y)) == (x, y)
    assert split_batch([x]) == (x, None)
    assert split_batch(x) == (x, None)
    assert split_batch({"input_ids": y, "labels": y, "attention_mask": y}) == (y, y)
    assert split_batch(UserDict({"pixel_values": x, "label": y})) == (x, y)  # BatchEncoding-like mappings
    assert split_batch(("text", 3)) == (None, None)
    for bad in (Hostile(), BadMapping({"x": x}), None, 42, [], {}):
        assert split_batch(bad) == (None, None)


def test_loss_sum_is_the_sum_and_refuses_what_it_cannot_add() -> None:
    s = LossSum()
    for v in (torch.tensor(0.5, requires_grad=True), torch.tensor([0.25]), "x", torch.ones(3), None):
        s.add(v)  # a string, a 3-element tensor and None are left out, silently
    total = s.take()
    assert float(total) == 0.75 and not total.requires_grad
    assert s.take() is None


def test_wrap_method_undoes_only_its_own_wrapper() -> None:
    class Owner:
        def f(self) -> str:
            return "orig"

    o, cleanups = Owner(), []
    assert wrap_method(o, "f", lambda orig: lambda: "wrapped:" + orig(), cleanups)
    assert o.f() == "wrapped:orig"
    cleanups.pop()()
    assert o.f() == "orig" and "f" not in o.__dict__
    assert wrap_method(o, "f", lambda orig: lambda: "mine", cleanups)
    o.f = lambda: "someone else's"  # wrapped again on top of us: our undo must leave theirs alone
    cleanups.pop()()
    assert o.f() == "someone else's"
    assert not wrap_method(o, "missing", lambda orig: orig, cleanups)
