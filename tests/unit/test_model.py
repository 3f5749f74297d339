"""The framework-free training core (app.model): numerics every trainer shares."""

from __future__ import annotations

import copy

import torch
from torch import nn

from app import model as core


def _linear_batches(seed: int, n: int, batch: int):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=generator)
    y = (x[:, 0] > 0).long()
    return [(x[i : i + batch], y[i : i + batch]) for i in range(0, n, batch)]


def test_grad_accumulation_matches_a_larger_batch():
    torch.manual_seed(0)
    base = nn.Linear(8, 2)
    small, large = copy.deepcopy(base), copy.deepcopy(base)
    loss_fn = nn.CrossEntropyLoss()
    opt_small = torch.optim.SGD(small.parameters(), lr=0.1)
    opt_large = torch.optim.SGD(large.parameters(), lr=0.1)
    cpu = torch.device("cpu")
    core.train_epoch(small, _linear_batches(1, 64, 8), opt_small, loss_fn, device=cpu, grad_accum=2)
    core.train_epoch(large, _linear_batches(1, 64, 16), opt_large, loss_fn, device=cpu, grad_accum=1)
    for a, b in zip(small.parameters(), large.parameters()):
        assert torch.allclose(a, b, atol=1e-6)
    changed = copy.deepcopy(base)
    assert not torch.allclose(changed.weight, small.weight)  # the steps really happened


def test_bf16_autocast_on_cpu_lowers_the_loss():
    torch.manual_seed(0)
    net = core.build_model("cnn", 2)
    images = torch.randn(32, 3, 16, 16)
    labels = (images[:, 0].mean((1, 2)) > 0).long()
    batches = [(images[i : i + 8], labels[i : i + 8]) for i in range(0, 32, 8)]
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    losses = [
        core.train_epoch(
            net, batches, optimizer, nn.CrossEntropyLoss(), device=torch.device("cpu"), amp=torch.bfloat16
        )["loss"]
        for _ in range(8)
    ]
    assert losses[-1] < losses[0] * 0.7, losses


def test_parameter_checksum_detects_any_difference():
    net = core.build_model("cnn", 3)
    twin = copy.deepcopy(net)
    assert core.parameter_checksum(net) == core.parameter_checksum(twin)
    with torch.no_grad():
        twin.head.bias[0] += 1e-7
    assert core.parameter_checksum(net) != core.parameter_checksum(twin)


def test_amp_auto_is_off_on_cpu():
    assert core.amp_dtype("auto", torch.device("cpu")) is None
    assert core.amp_dtype("bf16", torch.device("cpu")) is torch.bfloat16
