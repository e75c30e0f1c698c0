"""The verdict for people: a rich table for the terminal, and a self-contained HTML page (inline
SVG and CSS, no script from anywhere) with a timeline per observer."""

from __future__ import annotations

import html
from collections import defaultdict
from typing import TYPE_CHECKING

from rich.table import Table

from orch_verify.judge import GROWTH_FLAG, Copy, Verdict

if TYPE_CHECKING:
    from orch_verify.campaign import Campaign

PALETTE = ("#4e79a7", "#59a14f", "#9c755f", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#bab0ac")


def _stop_cell(v: Verdict, kind: str) -> str:
    p = v.kinds[kind].stop_percentiles()
    return "-" if p is None else f"{p[0]:.2f} / {p[1]:.2f} / {p[2]:.2f}"


def _growth_cell(growth: float | None) -> str:
    return "-" if growth is None else f"{growth / 1024:.1f}"


def table(v: Verdict) -> Table:
    t = Table(title="per kind", title_justify="left")
    for col in (
        "kind",
        "observers",
        "failed",
        "stop after cancel s (p50/p99/max)",
        "ignored cancel",
        "stalls (longest s)",
        "memory KiB/observer/min",
    ):
        t.add_column(col, justify="left" if col == "kind" else "right")
    for kind, k in sorted(v.kinds.items()):
        growth = _growth_cell(k.growth)
        if k.growth is not None and k.growth > GROWTH_FLAG:
            growth = f"[red]{growth}[/red]"
        t.add_row(
            kind,
            str(k.observers),
            str(k.failed),
            _stop_cell(v, kind),
            f"[red]{len(k.ignored)}[/red]" if k.ignored else "0",
            f"{k.stalls} ({k.longest_stall:.2f})" if k.stalls else "0",
            growth,
        )
    return t


def html_report(v: Verdict, campaign: Campaign, seed: int) -> str:
    """The page: verdict, timeline (one row per observer, one bar per copy coloured by its
    service process, overlaps in red, faults as marks on the shared axis), tables."""
    zero = campaign.wall0
    copies_by_observer: dict[str, list[Copy]] = defaultdict(list)
    for c in v.copies.values():
        copies_by_observer[c.observer].append(c)
    end = max([c.last for c in v.copies.values()] + [zero + 1]) - zero
    pids = sorted({c.pid for c in v.copies.values()})
    colour = {pid: PALETTE[i % len(PALETTE)] for i, pid in enumerate(pids)}
    names = campaign.processes
    kinds = {str(o): k for o, k in campaign.kinds.items()}
    overlapping = {o.observer for o in v.overlaps}

    left, width, row = 230, 900, 18
    observers = sorted(
        copies_by_observer, key=lambda o: (o not in overlapping, kinds.get(o, ""), o)
    )
    height = 40 + row * len(observers)

    def x(t: float) -> float:
        return left + width * max(0.0, t - zero) / end

    svg = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 20}" height="{height}" '
        f'font-family="sans-serif" font-size="11">'
    ]
    for s in range(0, int(end) + 1, max(1, int(end) // 12 or 1)):
        px = left + width * s / end
        svg.append(f'<line x1="{px:.1f}" y1="20" x2="{px:.1f}" y2="{height}" stroke="#eee"/>')
        svg.append(f'<text x="{px:.1f}" y="14" text-anchor="middle">{s}s</text>')
    for e in campaign.events:
        px = left + width * (campaign.began + e.at) / end
        tip = html.escape(
            f"{e.at:.2f}s {e.what}" + (f" (skipped: {e.skipped})" if e.skipped else "")
        )
        stroke = "#bbb" if e.skipped else "#e15759"
        svg.append(
            f'<line x1="{px:.1f}" y1="20" x2="{px:.1f}" y2="{height}" stroke="{stroke}" '
            f'stroke-dasharray="2,3"><title>{tip}</title></line>'
        )
    for i, o in enumerate(observers):
        y = 26 + i * row
        label = html.escape(f"{kinds.get(o, '?')} {o[:8]}")
        weight = ' font-weight="bold" fill="#c00"' if o in overlapping else ""
        svg.append(f'<text x="4" y="{y + 11}"{weight}>{label}</text>')
        for c in sorted(copies_by_observer[o], key=lambda c: c.first):
            x1, x2 = x(c.first), max(x(c.last), x(c.first) + 2)
            tip = html.escape(
                f"{o} epoch {c.epoch} on {names.get(c.pid, '?')} (pid {c.pid}): "
                f"{c.first - zero:.2f}s to {c.last - zero:.2f}s"
                + (f", asked to stop at {c.stop_at - zero:.2f}s" if c.stop_at else "")
            )
            svg.append(
                f'<rect x="{x1:.1f}" y="{y}" width="{x2 - x1:.1f}" height="{row - 5}" '
                f'fill="{colour[c.pid]}"><title>{tip}</title></rect>'
            )
    for ov in v.overlaps:
        i = observers.index(ov.observer)
        a, b = x(ov.b.first), max(x(min(ov.a.last, ov.b.last)), x(ov.b.first) + 3)
        svg.append(
            f'<rect x="{a:.1f}" y="{24 + i * row}" width="{b - a:.1f}" height="{row - 1}" '
            f'fill="none" stroke="#d00" stroke-width="2"><title>overlap</title></rect>'
        )
    svg.append("</svg>")

    legend = " ".join(
        f'<span class="chip" style="background:{colour[p]}"></span>'
        f"{html.escape(names.get(p, '?'))} (pid {p})"
        for p in pids
    )
    findings = "".join(f"<li>{html.escape(line)}</li>" for line in v.lines())
    rows = "".join(
        "<tr>"
        + "".join(
            f"<td>{html.escape(str(cell))}</td>"
            for cell in (
                kind,
                k.observers,
                k.failed,
                _stop_cell(v, kind),
                len(k.ignored),
                f"{k.stalls} ({k.longest_stall:.2f}s)" if k.stalls else 0,
                _growth_cell(k.growth),
            )
        )
        + "</tr>"
        for kind, k in sorted(v.kinds.items())
    )
    faults = "".join(
        f"<tr><td>{e.at:.2f}s</td><td>{html.escape(e.what)}</td>"
        f"<td>{html.escape(e.skipped or '')}</td></tr>"
        for e in campaign.events
    )
    status = "passed" if v.passed else "failed"
    found = v.outputs
    emitting = sorted(
        set(found.repeats)
        | set(found.gaps)
        | set(found.out_of_order)
        | set(found.stale)
        | set(found.conflicts),
        key=lambda oid: (v.observer_kinds.get(oid, ""), oid),
    )
    output_rows = "".join(
        f"<tr><td>{html.escape(v.observer_kinds.get(oid, '?'))} {html.escape(oid)}</td>"
        f"<td>{found.repeats.get(oid, 0)}</td>"
        f"<td>{sum(b - a + 1 for a, b in found.gaps.get(oid, []))}</td>"
        f"<td>{len(found.out_of_order.get(oid, []))}</td>"
        f"<td>{len(found.stale.get(oid, []))}</td>"
        f"<td>{len(found.conflicts.get(oid, []))}</td></tr>"
        for oid in emitting
    )
    outputs = (
        f"<p>{found.received} records received once each by a plain consumer of the outputs "
        f"exchange; observers with anything to report:</p><table><tr><th>observer</th>"
        f"<th>repeats (allowed)</th><th>seqs never received</th><th>out of order</th>"
        f"<th>stale epoch</th><th>two records, one seq</th></tr>{output_rows}</table>"
        if found.received or emitting
        else "<p>No observer emitted anything.</p>"
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>orch verify, seed {seed}: {status}</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; color: #222; }}
.passed {{ color: #2a7d2a; }} .failed {{ color: #c00; }}
table {{ border-collapse: collapse; margin: 1em 0; }}
td, th {{ border: 1px solid #ccc; padding: 3px 8px; text-align: right; }}
td:first-child, th:first-child {{ text-align: left; }}
.chip {{ display: inline-block; width: 12px; height: 12px; margin: 0 4px 0 12px; }}
.scroll {{ overflow-x: auto; }}
.left td, .left th {{ text-align: left; }}
</style></head><body>
<h1>orch verify, seed {seed}: <span class="{status}">{status}</span></h1>
<ul>{findings}</ul>
<h2>Timeline</h2>
<p>One row per observer, one bar per copy, coloured by the process that ran it; red outline:
two copies at once; dashed lines: faults (hover for each).</p>
<p>{legend}</p>
<div class="scroll">{"".join(svg)}</div>
<h2>Per kind</h2>
<table><tr><th>kind</th><th>observers</th><th>failed</th><th>stop after cancel s (p50/p99/max)</th>
<th>ignored cancel</th><th>stalls (longest)</th><th>memory KiB/observer/min</th></tr>{rows}</table>
<h2>Outputs</h2>
{outputs}
<h2>Faults</h2>
<table class="left"><tr><th>at</th><th>fault</th><th>skipped</th></tr>{faults}</table>
</body></html>
"""
