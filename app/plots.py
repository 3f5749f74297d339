"""Loss and accuracy curves as PNG artifacts (matplotlib, headless)."""

from __future__ import annotations


def save_curves(history: list[dict], path: str, title: str, x: str = "epoch") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [row[x] for row in history]
    figure, (loss_axis, accuracy_axis) = plt.subplots(1, 2, figsize=(9, 3.5))
    for key in ("train_loss", "val_loss"):
        if any(key in row for row in history):
            loss_axis.plot(steps, [row.get(key) for row in history], marker="o", label=key)
    for key in ("train_accuracy", "val_accuracy"):
        if any(key in row for row in history):
            accuracy_axis.plot(steps, [row.get(key) for row in history], marker="o", label=key)
    loss_axis.set(xlabel=x, title="loss")
    accuracy_axis.set(xlabel=x, title="accuracy", ylim=(0, 1))
    for axis in (loss_axis, accuracy_axis):
        if axis.get_lines():  # a federated run under DP records no per-client curves
            axis.legend()
        axis.grid(alpha=0.3)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
