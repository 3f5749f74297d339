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
    """The forward pass really runs in bfloat16 (a hook on the first convolution sees its output
    dtype; fp32 without `amp`), and training under it still learns."""
    torch.manual_seed(0)
    net = core.build_model("cnn", 2)
    images = torch.randn(32, 3, 16, 16)
    labels = (images[:, 0].mean((1, 2)) > 0).long()
    batches = [(images[i : i + 8], labels[i : i + 8]) for i in range(0, 32, 8)]
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    seen: list[torch.dtype] = []
    net.features[0][0].register_forward_hook(lambda module, inputs, output: seen.append(output.dtype))

    def epoch(amp):
        return core.train_epoch(
            net, batches, optimizer, nn.CrossEntropyLoss(), device=torch.device("cpu"), amp=amp
        )["loss"]

    losses = [epoch(torch.bfloat16) for _ in range(8)]
    assert set(seen) == {torch.bfloat16} and len(seen) == 8 * len(batches), seen
    assert all(p.dtype == torch.float32 for p in net.parameters())  # autocast, not a bf16 model
    assert losses[-1] < losses[0] * 0.7, losses
    seen.clear()
    epoch(None)
    assert set(seen) == {torch.float32}


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


def test_a_short_last_window_is_the_mean_of_its_own_examples():
    """5 micro-batches with grad_accum=2: the last step has one micro-batch (of 3 examples, not 4)
    and must take the plain mean gradient over those examples, not half of it."""
    torch.manual_seed(0)
    net = nn.Linear(8, 2, bias=False)
    batches = _linear_batches(2, 19, 4)  # 4 + 4 | 4 + 4 | 3
    loss_fn = nn.CrossEntropyLoss()
    reference = copy.deepcopy(net)
    for window in (batches[0:2], batches[2:4], batches[4:5]):
        x = torch.cat([b[0] for b in window])
        y = torch.cat([b[1] for b in window])
        reference.zero_grad()
        loss_fn(reference(x), y).backward()
        with torch.no_grad():
            reference.weight -= 0.5 * reference.weight.grad
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
    stats = core.train_epoch(net, batches, optimizer, loss_fn, device=torch.device("cpu"), grad_accum=2)
    assert stats["micro_batches"] == 5 and stats["examples"] == 19
    assert torch.allclose(net.weight, reference.weight, atol=1e-6)


def test_warmup_then_cosine_and_a_resumed_schedule_continues():
    param = nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=1.0)
    schedule = core.warmup_cosine(optimizer, total_steps=20, warmup_fraction=0.2)
    lrs = []
    for _ in range(20):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert lrs[0] < lrs[1] < lrs[3] and max(lrs) == lrs[4] == 1.0  # 4 warmup steps, then the peak
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:])) and lrs[-1] < 0.01

    # A run resumed after step 7 from a checkpoint (optimiser and schedule, as train saves them)
    # takes the same learning rates as the run that was never interrupted.
    optimizer = torch.optim.SGD([param], lr=1.0)
    first = core.warmup_cosine(optimizer, total_steps=20, warmup_fraction=0.2)
    for _ in range(7):
        optimizer.step()
        first.step()
    saved = torch.load(_roundtrip({"optimizer": optimizer.state_dict(), "scheduler": first.state_dict()}))
    optimizer = torch.optim.SGD([param], lr=1.0)
    resumed = core.warmup_cosine(optimizer, total_steps=20, warmup_fraction=0.2)
    optimizer.load_state_dict(saved["optimizer"])
    resumed.load_state_dict(saved["scheduler"])
    after = []
    for _ in range(13):
        after.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        resumed.step()
    assert after == lrs[7:]


def _roundtrip(state):
    import io

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer  # torch.load(..., weights_only=True) by default: what train's checkpoints allow


def test_adamw_decays_weights_but_not_biases_or_norm_scales():
    optimizer = core.adamw(core.build_model("cnn", 3), lr=1e-3, weight_decay=0.05)
    decayed, kept = optimizer.param_groups
    assert decayed["weight_decay"] == 0.05 and all(p.dim() > 1 for p in decayed["params"])
    assert kept["weight_decay"] == 0.0 and all(p.dim() == 1 for p in kept["params"])


def test_pretrained_weights_load_every_backbone_tensor(tmp_path):
    import torchvision

    source = torchvision.models.resnet18(weights=None)  # random init stands in for real weights
    path = tmp_path / "resnet18.pt"
    torch.save(source.state_dict(), path)
    net = core.build_model("resnet18", 4, weights=str(path))
    loaded = net.state_dict()
    backbone = {k: v for k, v in source.state_dict().items() if not k.startswith("fc.")}
    assert backbone and all(torch.equal(loaded[k], v) for k, v in backbone.items())
    assert loaded["fc.weight"].shape == (4, 512)  # the classifier is new, for this run's classes


def test_weights_that_do_not_fit_are_an_error(tmp_path):
    import pytest
    import torchvision

    other = tmp_path / "resnet50.pt"
    torch.save(torchvision.models.resnet50(weights=None).state_dict(), other)
    with pytest.raises(core.WeightsMismatch, match="does not fit ResNet"):
        core.build_model("resnet18", 4, weights=str(other))
    partial = tmp_path / "partial.pt"
    state = torchvision.models.resnet18(weights=None).state_dict()
    del state["layer1.0.conv1.weight"]
    torch.save(state, partial)
    with pytest.raises(core.WeightsMismatch, match="1 missing"):
        core.build_model("resnet18", 4, weights=str(partial))
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a state dict")
    with pytest.raises(core.WeightsMismatch, match="not a readable state dict"):
        core.build_model("resnet18", 4, weights=str(garbage))
