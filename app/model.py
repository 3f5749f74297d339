"""The framework-free core that Ray Train, the Flower clients and the Serve replicas share:
the model factory, one training epoch, evaluation, and safe (de)serialisation of weights.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import warnings
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from app.errors import ConfigError

log = logging.getLogger(__name__)

FEATURE_DIM = 2048
BACKBONE_SEED = 0
"""Random backbones are seeded so ingest (features) and serving (images) use the same one."""


class SmallCNN(nn.Module):
    """Three conv blocks and a linear head: learns 32–64 px behaviour images quickly on a CPU."""

    def __init__(self, num_classes: int, width: int = 32):
        super().__init__()

        def block(cin, cout):
            return nn.Sequential(
                nn.Conv2d(cin, cout, 3, padding=1, bias=False),
                nn.BatchNorm2d(cout),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(2),
            )

        self.features = nn.Sequential(
            block(3, width),
            block(width, 2 * width),
            block(2 * width, 4 * width),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.head = nn.Linear(4 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class FeatureHead(nn.Module):
    """A frozen ResNet-50 backbone and a trainable head; trains on precomputed features.

    `forward` takes images [N, 3, H, W] (serving) or the snapshot's features [N, 2048] (training),
    so DDP wraps it like any other model.
    """

    def __init__(self, num_classes: int, weights: str | None = None):
        super().__init__()
        self.backbone = feature_backbone(weights)
        self.backbone.requires_grad_(False)
        self.head = nn.Linear(FEATURE_DIM, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return self.head(x)
        with torch.no_grad():
            features = self.backbone.eval()(x)
        return self.head(features)


class WeightsMismatch(ConfigError):
    """A weights file whose tensors do not fit the architecture (names or shapes)."""


def _load_weights(model: nn.Module, weights: str | None, skip: tuple[str, ...] = ()) -> None:
    """Load every tensor of `model` from `weights` (but the `skip` prefixes, which the model
    replaces): a missing, unexpected or misshapen tensor is a WeightsMismatch, never a log line."""
    if weights is None:
        warnings.warn(
            f"no pretrained weights given for {type(model).__name__}: using random "
            "initialisation (pass a local path; nothing is downloaded)",
            stacklevel=3,
        )
        return
    try:
        state = {k: v for k, v in load_state_dict(weights).items() if not k.startswith(skip)}
    except Exception as exc:
        raise WeightsMismatch(f"--weights {weights}: not a readable state dict ({exc})") from None
    expected = {k: v.shape for k, v in model.state_dict().items() if not k.startswith(skip)}
    missing = sorted(expected.keys() - state.keys())
    unexpected = sorted(state.keys() - expected.keys())
    misshapen = sorted(k for k in expected.keys() & state.keys() if state[k].shape != expected[k])
    if missing or unexpected or misshapen:

        def few(names):
            return ", ".join(names[:3]) + (" ..." if len(names) > 3 else "")

        raise WeightsMismatch(
            f"--weights {weights} does not fit {type(model).__name__}: {len(missing)} missing "
            f"({few(missing)}), {len(unexpected)} unexpected ({few(unexpected)}), "
            f"{len(misshapen)} of another shape ({few(misshapen)})"
        )
    model.load_state_dict(state, strict=False)
    log.info("loaded all %d tensors from %s", len(state), weights)


def feature_backbone(weights: str | None = None) -> nn.Module:
    """ResNet-50 without its classifier: images → 2048-d features."""
    import torchvision

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(BACKBONE_SEED)
        backbone = torchvision.models.resnet50(weights=None)
    backbone.fc = nn.Identity()
    _load_weights(backbone, weights, skip=("fc.",))
    return backbone


def local_device() -> torch.device:
    """The GPU Ray gave this process (it sets CUDA_VISIBLE_DEVICES for `num_gpus`), else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def build_model(
    name: str, num_classes: int, *, weights: str | None = None, features: bool = False
) -> nn.Module:
    """The one model factory: `resnet50`, `resnet18`, `cnn`; `features=True` → frozen ResNet-50 + head."""
    import torchvision

    if features:
        return FeatureHead(num_classes, weights)
    if name == "cnn":
        return SmallCNN(num_classes)
    if name in ("resnet18", "resnet50"):
        model = getattr(torchvision.models, name)(weights=None)
        if weights is not None:
            _load_weights(model, weights, skip=("fc.",))  # the classifier is new: other classes
        model.fc = nn.Linear(model.fc.in_features, num_classes)
        return model
    raise ValueError(f"unknown model {name!r}")


def parameter_checksum(model: nn.Module) -> str:
    """SHA-256 over every parameter and buffer, in name order: equal iff replicas agree bit for bit."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def save_state_dict(model: nn.Module, path: str) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().cpu().contiguous() for k, v in unwrap(model).state_dict().items()}, path)


def load_state_dict(path: str) -> dict[str, torch.Tensor]:
    """Weights from safetensors, or a torch file loaded with weights_only (never arbitrary pickles)."""
    if str(path).endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    return torch.load(path, map_location="cpu", weights_only=True)


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if hasattr(model, "module") else model


def amp_dtype(mode: str, device: torch.device) -> torch.dtype | None:
    """`auto` is bf16 on GPUs that have it (fp16 otherwise) and off on CPU, where bf16 is slow."""
    if mode == "off" or (mode == "auto" and device.type != "cuda"):
        return None
    if mode == "bf16" or (mode == "auto" and torch.cuda.is_bf16_supported()):
        return torch.bfloat16
    return torch.float16


def train_epoch(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    optimizer,
    loss_fn: nn.Module,
    *,
    device: torch.device,
    amp: torch.dtype | None = None,
    scaler: torch.amp.GradScaler | None = None,
    grad_accum: int = 1,
    scheduler=None,
) -> dict[str, float]:
    """One pass; an optimiser step every `grad_accum` micro-batches, gradient sync only on that one.

    Under DDP, `no_sync()` skips the all-reduce on the other micro-batches, so K micro-batches cost
    one all-reduce. Each step's gradient is the example-weighted mean over the micro-batches of its
    window, whatever its real size: the last window of an epoch may hold fewer than K micro-batches
    (and its last micro-batch fewer examples), and is not divided by K. `scheduler` steps with the
    optimiser.
    """
    model.train()
    total_loss, total_examples, correct = 0.0, 0, 0
    optimizer.zero_grad(set_to_none=True)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    micro, nominal, window_examples = 0, 0, 0
    for micro, ((inputs, targets), is_last) in enumerate(_lookahead(batches), start=1):
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        n = len(targets)
        nominal = nominal or n  # gradients stay at a mean batch's scale (fp16 loss scaling expects it)
        step_now = micro % grad_accum == 0 or is_last
        sync = contextlib.nullcontext() if step_now or not hasattr(model, "no_sync") else model.no_sync()
        with sync:
            with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
                logits = model(inputs)
            loss = loss_fn(logits.float(), targets)
            weighted = loss * (n / nominal)
            (scaler.scale(weighted) if scaler else weighted).backward()
        window_examples += n
        if step_now:
            rescale = nominal / window_examples  # the sum of example-weighted losses → their mean
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(rescale)
            if scaler:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            if scheduler is not None:
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            window_examples = 0
        total_loss += loss.item() * n
        total_examples += n
        correct += (logits.argmax(1) == targets).sum().item()
    return {
        "loss": total_loss / max(total_examples, 1),
        "accuracy": correct / max(total_examples, 1),
        "examples": total_examples,
        "micro_batches": micro,
    }


def warmup_cosine(optimizer, total_steps: int, warmup_fraction: float) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over the first `warmup_fraction` of the steps, then cosine decay to zero at
    `total_steps` (held there if a run takes more steps). Its state, the step count, is what a
    checkpoint saves to continue the schedule."""
    import math

    total = max(1, total_steps)
    warmup = int(total * warmup_fraction)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def adamw(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with weight decay on weight matrices and kernels only: decaying biases and
    normalisation scales only fights the normalisation."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trainable if p.dim() > 1]
    rest = [p for p in trainable if p.dim() <= 1]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr)


def _lookahead(iterable: Iterable) -> Iterator[tuple[object, bool]]:
    """Yield (item, is_last) so the final partial accumulation window still steps."""
    iterator = iter(iterable)
    try:
        previous = next(iterator)
    except StopIteration:
        return
    for item in iterator:
        yield previous, False
        previous = item
    yield previous, True


@torch.inference_mode()
def evaluate(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    num_classes: int,
    *,
    device: torch.device,
    loss_fn: nn.Module | None = None,
) -> dict:
    """Loss, accuracy, per-class recall and the confusion matrix (rows: truth, columns: prediction)."""
    model.eval()
    loss_fn = loss_fn or nn.CrossEntropyLoss()
    confusion = torch.zeros((num_classes, num_classes), dtype=torch.int64)
    total_loss, total = 0.0, 0
    for inputs, targets in batches:
        inputs, targets = inputs.to(device), targets.to(device)
        logits = model(inputs).float()
        total_loss += loss_fn(logits, targets).item() * len(targets)
        total += len(targets)
        predictions = logits.argmax(1)
        confusion += torch.bincount(
            targets.cpu() * num_classes + predictions.cpu(), minlength=num_classes * num_classes
        ).view(num_classes, num_classes)
    support = confusion.sum(1)
    recall = torch.where(support > 0, confusion.diag() / support.clamp(min=1), torch.nan)
    return {
        "loss": total_loss / max(total, 1),
        "accuracy": (confusion.diag().sum() / max(total, 1)).item(),
        "per_class_recall": [None if torch.isnan(r) else r.item() for r in recall],
        "confusion": confusion.tolist(),
        "examples": total,
    }
