"""A plot of a run's checkpoint timeline, per phase (optional: needs matplotlib, the `plot` extra).

Each save is a row of bars on a time axis: blocked (snapshot on the training thread), write (checksums,
writes, fsyncs), commit (manifest, rename) and, with tiers, migration. Reads only SaveStats.
"""

from __future__ import annotations

from typing import Any, Sequence

PHASES = (
    ("blocked_s", "blocked (snapshot)", "tab:red"),
    ("write_s", "write + fsync", "tab:blue"),
    ("commit_s", "commit", "tab:green"),
    ("migrate_s", "migration", "tab:purple"),
)


def plot_timeline(stats: Sequence[Any], ax: Any = None, title: str = "checkpoint timeline") -> Any:
    """Draws ``stats`` (a manager's ``.stats``) on ``ax`` (a new figure's axes if None); returns ax."""
    try:
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("plot_timeline needs matplotlib: pip install 'flax-ckpt[plot]'") from e
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 0.4 * max(3, len(stats)) + 1))
    seen = set()
    for row, s in enumerate(stats):
        t = s.start_s
        for field, label, color in PHASES:
            width = getattr(s, field, 0.0)
            if width <= 0:
                continue
            ax.barh(row, width, left=t, color=color, label=None if label in seen else label)
            seen.add(label)
            t += width
    ax.set_yticks(range(len(stats)), [f"step {s.step}" for s in stats])
    ax.set_xlabel("seconds since the manager started")
    ax.set_title(title)
    if seen:
        ax.legend(loc="lower right", fontsize="small")
    return ax
