"""The first step's hooks (publisher/first_step.py): they learn the backward order, then leave nothing wired.

A removed autograd hook can stay wired into the engine with an empty dict, called on every backward for
the rest of the run (docs/design.md, Torch 10); these tests hold FirstStep to unwiring what it added and
to leaving the user's own hooks alone.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from gradwatch.publisher.first_step import FirstStep


class Tied(nn.Module):
    """An embedding whose weight is also the output layer's: one parameter used twice in backward."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 12)
        self.mid = nn.Linear(12, 12)
        self.out = nn.Linear(12, 40, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.mid(self.emb(x))))


def _models() -> list[tuple[str, nn.Module, Any]]:
    return [
        ("mlp", nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1)),
         lambda: torch.randn(8, 5)),
        ("transformer", nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 2,
                                              enable_nested_tensor=False), lambda: torch.randn(2, 5, 16)),
        ("rnn", nn.RNN(4, 8, batch_first=True), lambda: torch.randn(2, 6, 4)),
        ("tied", Tied(), lambda: torch.randint(0, 40, (3, 7))),
    ]


def _loss(model: nn.Module, inp: Any) -> torch.Tensor:
    out = model(inp())
    out = out[0] if isinstance(out, tuple) else out
    return out.float().pow(2).mean()


def _reference_order(model: nn.Module, params: list[nn.Parameter], inp: Any) -> list[int]:
    """The order autograd accumulates the gradients in, seen by post-accumulate-grad hooks on a copy."""
    order: list[int] = []
    handles = [p.register_post_accumulate_grad_hook(lambda _p, i=i: order.append(i)) for i, p in enumerate(params)]
    _loss(model, inp).backward()
    for h in handles:
        h.remove()
    return order


@pytest.mark.parametrize("seed", [0, 3])
@pytest.mark.parametrize("name", ["mlp", "transformer", "rnn", "tied"])
def test_learns_the_backward_order_then_unwires_every_hook(name: str, seed: int) -> None:
    torch.manual_seed(seed)
    _, model, inp = next(m for m in _models() if m[0] == name)
    params = [p for p in model.parameters() if p.requires_grad]
    first = FirstStep()
    first.learn(model, params)
    assert first.pending and all(p._backward_hooks for p in params)
    torch.manual_seed(seed + 100)
    _loss(model, inp).backward()
    meta: dict[str, Any] = {}
    first.take(meta, params)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed + 100)
    expected = _reference_order(model, params, inp)
    seen: set[int] = set()
    assert meta["backward_order"] == [i for i in expected if not (i in seen or seen.add(i))]
    assert not first.pending
    assert all(p._backward_hooks is None for p in params)  # unwired, not merely emptied


def test_a_users_own_hook_is_kept_and_still_fires() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    params = list(model.parameters())
    calls: list[int] = []
    mine = params[0].register_hook(lambda g: calls.append(1))
    first = FirstStep()
    first.learn(model, params)
    model(torch.randn(2, 3)).sum().backward()
    first.take({}, params)
    assert params[0]._backward_hooks and len(params[0]._backward_hooks) == 1  # the user's, and only it
    assert all(p._backward_hooks is None for p in params[1:])
    model.zero_grad()
    model(torch.randn(2, 3)).sum().backward()
    assert calls == [1, 1]
    mine.remove()


def test_the_users_hook_registered_after_ours_survives_the_drop() -> None:
    """A dict that is not empty after our removals is someone else's too: it stays wired."""
    model = nn.Sequential(nn.Linear(3, 2))
    params = list(model.parameters())
    first = FirstStep()
    first.learn(model, params)
    calls: list[int] = []
    params[1].register_hook(lambda g: calls.append(1))
    model(torch.randn(2, 3)).sum().backward()
    first.drop()
    assert params[0]._backward_hooks is None and params[1]._backward_hooks
    model(torch.randn(2, 3)).sum().backward()
    assert calls == [1, 1]
