"""Plots of the synthetic study (matplotlib, Agg backend): the Shannon-phi plane of scale
against direction error per location (K, V, T), KL distributions and routing recall."""

from __future__ import annotations

import pathlib

import numpy as np


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def shannon_phi_plane(rows: list[dict], out: pathlib.Path) -> pathlib.Path:
    """SNR (dB) against direction angle (rad) for K, V and T, one colour per scheme, one marker
    per budget n."""
    plt = _plt()
    schemes = sorted({r["scheme"] for r in rows})
    bits = sorted({r["bits"] for r in rows})
    markers = "os^Dv<>p"
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, loc in zip(axes, "kvt"):
        for i, s in enumerate(schemes):
            for j, n in enumerate(bits):
                pts = [(r[f"snr_{loc}"], r[f"phi_{loc}"]) for r in rows if r["scheme"] == s and r["bits"] == n]
                if pts:
                    x, y = np.array(pts).T
                    ax.scatter(x, y, s=8, alpha=0.5, color=f"C{i}", marker=markers[j % len(markers)], label=f"{s} n={n}")
        ax.set_xlabel(f"SNR_{loc.upper()} (dB)")
        ax.set_ylabel(f"phi_{loc.upper()} (rad)")
        ax.set_yscale("log")
        ax.set_title(f"{loc.upper()}: scale vs direction")
    axes[-1].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    path = out / "shannon_phi_plane.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def kl_distributions(rows: list[dict], out: pathlib.Path) -> pathlib.Path:
    """Box plots of per-sample mean KL (log scale) per scheme and budget."""
    plt = _plt()
    schemes = sorted({r["scheme"] for r in rows})
    bits = sorted({r["bits"] for r in rows})
    fig, axes = plt.subplots(1, len(bits), figsize=(5 * len(bits), 4), squeeze=False)
    for ax, n in zip(axes[0], bits):
        data = [[max(r["kl_mean"], 1e-12) for r in rows if r["scheme"] == s and r["bits"] == n] for s in schemes]
        ax.boxplot(data, tick_labels=schemes, showfliers=True)
        ax.set_yscale("log")
        ax.set_title(f"attention KL, n = {n}")
        ax.set_ylabel("mean KL(p || p_hat) per sample (nats)")
    fig.tight_layout()
    path = out / "kl_distributions.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def routing_recall(rows: list[dict], out: pathlib.Path) -> pathlib.Path:
    """Mean top-5 routing recall per scheme and budget, per distribution."""
    plt = _plt()
    schemes = sorted({r["scheme"] for r in rows})
    bits = sorted({r["bits"] for r in rows})
    dists = sorted({r["distribution"] for r in rows})
    fig, axes = plt.subplots(1, len(dists), figsize=(4.5 * len(dists), 4), squeeze=False)
    width = 0.8 / len(schemes)
    for ax, dist in zip(axes[0], dists):
        for i, s in enumerate(schemes):
            vals = [
                np.mean([r["topk_recall"] for r in rows if r["scheme"] == s and r["bits"] == n and r["distribution"] == dist] or [np.nan])
                for n in bits
            ]
            ax.bar(np.arange(len(bits)) + i * width, vals, width, label=s, color=f"C{i}")
        ax.set_xticks(np.arange(len(bits)) + 0.4 - width / 2, [f"n={n}" for n in bits])
        ax.set_ylim(0, 1.05)
        ax.set_title(dist)
        ax.set_ylabel("top-5 routing recall")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    path = out / "routing_recall.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
