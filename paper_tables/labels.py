"""Point labels that do not overlap: each label starts beside its point and is pushed vertically away from
the labels it collides with, then drawn with a thin leader line when it moved.

matplotlib places annotations where it is told; a scatter plot with clustered points (the paper's
models within a factor of two of each other) needs its labels spread, and readers need to see which
label belongs to which point. The placement runs in display coordinates on the figure's own renderer,
so it needs no pyplot and no GUI backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

GAP_PX = 2.0  # vertical gap kept between two labels, in pixels
OFFSET_PT = 5.0  # a label's natural distance from its point, in points
MARKER_RADIUS_PX = 5.0  # half the side of the box a marker occupies, in pixels


@dataclass
class PointLabel:
    """``text`` for the data point ``(x, y)``, drawn in ``color``."""

    x: float
    y: float
    text: str
    color: Any = "black"


def _overlap(a: list[float], b: list[float]) -> bool:
    """Do boxes ``[x0, y0, x1, y1]`` overlap (with the gap)?"""
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] + GAP_PX and b[1] < a[3] + GAP_PX


def place_labels(fig: Figure, ax: Any, labels: list[PointLabel], fontsize: float = 7.0, rounds: int = 300) -> list[Any]:
    """Annotate every label beside its point without overlaps; returns the annotation artists.

    Labels go right of their point, or left when that would leave the axes. Overlapping labels are moved
    apart vertically (each pair by half its overlap per round) until none overlap or ``rounds`` is spent;
    a label that moved more than a few points gets a leader line to its point.
    """
    if not labels:
        return []
    canvas = fig.canvas if isinstance(fig.canvas, FigureCanvasAgg) else FigureCanvasAgg(fig)
    renderer = canvas.get_renderer()
    px_per_pt = fig.dpi / 72.0
    ax_box = ax.get_window_extent(renderer)
    boxes, anchors, sides = [], [], []
    for lab in labels:
        px, py = ax.transData.transform((lab.x, lab.y))
        probe = ax.text(0, 0, lab.text, fontsize=fontsize)  # measured, then removed
        bb = probe.get_window_extent(renderer)
        probe.remove()
        w, h = bb.width, bb.height
        right = px + OFFSET_PT * px_per_pt + w <= ax_box.x1  # else the label goes left of its point
        x0 = px + OFFSET_PT * px_per_pt if right else px - OFFSET_PT * px_per_pt - w
        boxes.append([x0, py - h / 2, x0 + w, py + h / 2])
        anchors.append(py)
        sides.append(right)
    # Every marker is a fixed obstacle: a label is pushed off any point, its own included.
    r = MARKER_RADIUS_PX
    obstacles = [[x - r, y - r, x + r, y + r] for x, y in (ax.transData.transform((lab.x, lab.y)) for lab in labels)]
    for _ in range(rounds):
        moved = False
        for box in boxes:
            for ob in obstacles:
                if _overlap(box, ob):
                    centre, ob_centre = (box[1] + box[3]) / 2, (ob[1] + ob[3]) / 2
                    push = (ob[3] + GAP_PX - box[1]) if centre >= ob_centre else -(box[3] + GAP_PX - ob[1])
                    box[1] += push
                    box[3] += push
                    moved = True
            # Inside the axes vertically.
            shift = max(0.0, ax_box.y0 - box[1]) - max(0.0, box[3] - ax_box.y1)
            if shift:
                box[1] += shift
                box[3] += shift
        for i in range(len(boxes)):
            for j in range(i + 1, len(boxes)):
                a, b = boxes[i], boxes[j]
                if not _overlap(a, b):
                    continue
                up, down = (a, b) if ((a[1] + a[3]) / 2, anchors[i]) >= ((b[1] + b[3]) / 2, anchors[j]) else (b, a)
                push = (down[3] + GAP_PX - up[1]) / 2 + 0.5
                up[1] += push
                up[3] += push
                down[1] -= push
                down[3] -= push
                moved = True
        if not moved:
            break
    texts = []
    for lab, box, py, right in zip(labels, boxes, anchors, sides):
        dy_px = (box[1] + box[3]) / 2 - py
        leader = abs(dy_px) > 3 * px_per_pt
        texts.append(ax.annotate(
            lab.text, (lab.x, lab.y), xytext=(OFFSET_PT if right else -OFFSET_PT, dy_px / px_per_pt),
            textcoords="offset points", ha="left" if right else "right", va="center", fontsize=fontsize,
            color=lab.color, zorder=4,
            # A light backing: a connecting line drawn under a label does not strike through its text.
            bbox=dict(boxstyle="square,pad=0.1", facecolor="white", edgecolor="none", alpha=0.8),
            arrowprops=dict(arrowstyle="-", color=lab.color, linewidth=0.5, shrinkA=0, shrinkB=2) if leader else None))
    return texts
