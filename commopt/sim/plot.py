"""Plot a sweep: throughput and parallel efficiency against the swept axis (matplotlib).

>>> from commopt.sim import simulate, Configuration
>>> rows = [(n, simulate("resnet50", "v100-nvlink-25g", Configuration(), n)) for n in (8, 16)]
>>> import tempfile, os
>>> path = os.path.join(tempfile.mkdtemp(), "s.png")
>>> plot_sweep(rows, "gpus", path, title="resnet50") == path
True
"""

from __future__ import annotations


def _pyplot():
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError(
            "plotting needs matplotlib: pip install matplotlib (or commopt[plot])"
        ) from exc
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def plot_sweep(rows, axis: str, path: str, *, title: str = "") -> str:
    """Write a two-panel figure to ``path`` and return it."""
    if not rows:
        raise ValueError("nothing to plot: the sweep has no rows")
    plt = _pyplot()
    values = [v for v, _ in rows]
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    xs = values if numeric else list(range(len(values)))
    thr = [p.throughput for _, p in rows]
    eff = [100 * p.efficiency for _, p in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    try:
        for ax, ys, label in (
            (ax1, thr, f"throughput ({rows[0][1].unit}/s)"),
            (ax2, eff, "parallel efficiency (%)"),
        ):
            if numeric:
                ax.plot(xs, ys, marker="o")
                if (
                    axis in ("gpus", "inter_gbps", "bucket_cap_mb")
                    and min(xs) > 0
                    and max(xs) / min(xs) >= 8
                ):
                    ax.set_xscale("log", base=2)
            else:
                ax.bar(xs, ys)
                ax.set_xticks(xs, [str(v) for v in values])
            ax.set_xlabel(axis)
            ax.set_ylabel(label)
            ax.grid(True, alpha=0.3)
        if numeric and axis == "gpus":
            ideal = [rows[0][1].single_gpu_throughput * x for x in xs]
            ax1.plot(xs, ideal, linestyle="--", color="gray", label="linear")
            ax1.set_yscale("log")
            ax1.legend()
        ax2.set_ylim(0, 105)
        if title:
            fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return path
