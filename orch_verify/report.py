"""The verdict for people: a rich table for the terminal, and a self-contained HTML page (inline
SVG and CSS, no script from anywhere) with a timeline per observer."""

from __future__ import annotations

import html
from collections import defaultdict
from typing import TYPE_CHECKING

from rich.table import Table

from orch_verify.judge import Copy, Growth, Verdict

if TYPE_CHECKING:
    from orch_verify.campaign import Campaign

PALETTE = ("#4e79a7", "#59a14f", "#9c755f", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#bab0ac")


def colours(pids: list[int]) -> dict[int, str]:
    """A colour of its own for each process: the palette, then hues spread by the golden angle
    (a palette used round robin gave one colour to several processes)."""
    out = {}
    for i, pid in enumerate(pids):
        out[pid] = PALETTE[i] if i < len(PALETTE) else f"hsl({(i * 137.508) % 360:.0f}, 55%, 55%)"
    return out


def _stop_cell(v: Verdict, kind: str) -> str:
    p = v.kinds[kind].stop_percentiles()
    return "-" if p is None else f"{p[0]:.2f} / {p[1]:.2f} / {p[2]:.2f}"


def _growth_cell(memory: Growth | None) -> str:
    """Per observer: "flat", or the rate it grows at when flagged (``Growth.flagged``), and in
    brackets how much it grew over its samples. (The bare rate read "-35.8 (+7 KiB in 31s)": a
    trend's lesser half, negative beside a growth.)"""
    if memory is None:
        return "-"
    grown = f"({memory.grown / 1024:+.0f} KiB in {memory.span:.0f}s)"
    return f"{memory.rate / 1024:+.1f} KiB/min {grown}" if memory.flagged else f"flat {grown}"


def _downtime_cell(v: Verdict, kind: str) -> str:
    """Seconds its observers sat unrun (all gaps), as a share of their lives; and of those, the
    seconds no fault explains."""
    d = v.availability.downtime.get(kind)
    if d is None or d.live <= 0:
        return "-"
    cell = f"{d.unrun:.1f} ({100 * d.fraction:.2f} %)"
    return cell + (f", {d.unexplained:.1f} unexplained" if d.unexplained else "")


def table(v: Verdict) -> Table:
    t = Table(title="per kind", title_justify="left")
    for col in (
        "kind",
        "observers",
        "failed",
        "downtime s",
        "stop after cancel s (p50/p99/max)",
        "ignored cancel",
        "stalls (longest s)",
        "memory per observer",
    ):
        t.add_column(col, justify="left" if col == "kind" else "right")
    for kind, k in sorted(v.kinds.items()):
        growth = _growth_cell(k.memory)
        if k.grows:
            growth = f"[red]{growth}[/red]"
        downtime = _downtime_cell(v, kind)
        if "unexplained" in downtime:
            downtime = f"[red]{downtime}[/red]"
        t.add_row(
            kind,
            str(k.observers),
            str(k.failed),
            downtime,
            _stop_cell(v, kind),
            f"[red]{len(k.ignored)}[/red]" if k.ignored else "0",
            f"{k.stalls} ({k.longest_stall:.2f})" if k.stalls else "0",
            growth,
        )
    return t


def _findings(v: Verdict) -> dict[str, list[str]]:
    """Per observer, what the verdict found wrong with it (the timeline marks these)."""
    found: dict[str, list[str]] = defaultdict(list)
    for o in v.overlaps:
        if "OVERLAP" not in found[o.observer]:
            found[o.observer].append("OVERLAP")
    for oid in v.lost:
        found[oid].append("LOST")
    for oid in v.ran_after_delete:
        found[oid].append("RAN AFTER DELETE")
    for oid in {s.observer for s in v.availability.late_stops}:
        if "RAN AFTER DELETE" not in found[oid]:
            found[oid].append("RAN AFTER DELETE")
    for oid in {g.observer for g in v.availability.unavailable}:
        found[oid].append("UNAVAILABLE")
    return found


def timeline(v: Verdict, campaign: Campaign) -> str:
    """The SVG: one row per observer (those with findings first), one bar per copy from its
    first witness record to its last, coloured by its process; overlaps outlined in red; faults
    as dashed lines. A copy running at the end ends in an arrow; a LOST observer's last bar ends
    in a red cross where its last record is, and its label says LOST; a copy that ran after its
    observer's delete is outlined in red and its label says so."""
    zero = campaign.wall0
    copies_by_observer: dict[str, list[Copy]] = defaultdict(list)
    for c in v.copies.values():
        copies_by_observer[c.observer].append(c)
    end = max([c.last for c in v.copies.values()] + [zero + 1]) - zero
    pids = sorted({c.pid for c in v.copies.values()})
    colour = colours(pids)
    names = campaign.processes
    kinds = {str(o): k for o, k in campaign.kinds.items()}
    findings = _findings(v)

    left, width, row = 300, 900, 18
    # An observer with a finding has a row even if it never recorded a step.
    observers = sorted(
        set(copies_by_observer) | set(findings),
        key=lambda o: (o not in findings, kinds.get(o, ""), o),
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
        marks = findings.get(o, [])
        label = html.escape(" ".join([kinds.get(o, "?"), o[:8], *marks]))
        weight = ' font-weight="bold" fill="#c00"' if marks else ""
        svg.append(f'<text x="4" y="{y + 11}"{weight}>{label}</text>')
        cs = sorted(copies_by_observer[o], key=lambda c: (c.last, c.first))
        for c in sorted(cs, key=lambda c: c.first):
            # A bar ends where the copy's last record is, never after it: a short one grows
            # to the left to stay visible.
            x2 = x(c.last)
            x1 = min(x(c.first), x2 - 2)
            running = v.runs_at_end(c)
            after_delete = v.ran_after_its_delete(c)
            tip = html.escape(
                f"{o} epoch {c.epoch} on {names.get(c.pid, '?')} (pid {c.pid}): "
                f"{c.first - zero:.2f}s to {c.last - zero:.2f}s"
                + (f", asked to stop at {c.stop_at - zero:.2f}s" if c.stop_at else "")
                + (f", ended at {c.end_at - zero:.2f}s" if c.end_at is not None else "")
                + (", running at the end" if running else "")
                + (", ran after its observer was deleted" if after_delete else "")
            )
            outline = ' stroke="#d00" stroke-width="2"' if after_delete else ""
            svg.append(
                f'<rect x="{x1:.1f}" y="{y}" width="{x2 - x1:.1f}" height="{row - 5}" '
                f'fill="{colour[c.pid]}"{outline}><title>{tip}</title></rect>'
            )
            if running:
                mid = y + (row - 5) / 2
                svg.append(
                    f'<path d="M{x2:.1f},{y} L{x2 + 5:.1f},{mid:.1f} L{x2:.1f},{y + row - 5}Z" '
                    f'fill="{colour[c.pid]}"><title>running at the end</title></path>'
                )
        last = cs[-1] if cs else None
        if "LOST" in marks:
            svg.append(_lost_mark(v, last, x(last.last) if last else left, y, row, zero))
        if "RAN AFTER DELETE" in marks:
            epoch = v.deleted.get(o)
            svg.append(
                f'<text x="{x(last.last) + 4 if last else left:.1f}" y="{y + 11}" fill="#c00" '
                f'font-weight="bold" class="after-delete">!<title>RAN AFTER DELETE: a copy '
                f"ran after the delete was accepted (at epoch {epoch})</title></text>"
            )
    for g in v.availability.unavailable:
        i = observers.index(g.observer)
        a, b = x(g.start), max(x(g.end), x(g.start) + 3)
        tip = html.escape(
            f"UNAVAILABLE: no copy ran from {g.start - zero:.2f}s to {g.end - zero:.2f}s, "
            f"{g.beyond:.2f}s past what the faults explain"
        )
        svg.append(
            f'<rect class="unavailable" x="{a:.1f}" y="{24 + i * row}" width="{b - a:.1f}" '
            f'height="{row - 1}" fill="#f8d0d0" stroke="#d00" stroke-dasharray="3,2">'
            f"<title>{tip}</title></rect>"
        )
    for ov in v.overlaps:
        i = observers.index(ov.observer)
        a, b = x(ov.b.first), max(x(min(ov.a.last, ov.b.last)), x(ov.b.first) + 3)
        svg.append(
            f'<rect x="{a:.1f}" y="{24 + i * row}" width="{b - a:.1f}" height="{row - 1}" '
            f'fill="none" stroke="#d00" stroke-width="2"><title>overlap</title></rect>'
        )
    svg.append("</svg>")
    return "".join(svg)


def _lost_mark(v: Verdict, last: Copy | None, px: float, y: float, row: int, zero: float) -> str:
    """A red cross at the end of a LOST observer's last bar, where its last record is (at the
    start of the axis if it never recorded a step)."""
    if last is None:
        tip = "LOST: live, not running at the end; it never recorded a step"
    else:
        if last.end_at is not None:
            why = f"it ended at {last.end_at - zero:.2f}s"
        elif last.pid not in v.alive:
            why = "its process was gone at the end"
        else:
            why = "it was not running at the end"
        tip = (
            f"LOST: live, not running at the end; its last copy ({v.where(last)}) last "
            f"recorded at {last.last - zero:.2f}s, {why}"
        )
    tip = html.escape(tip)
    top, bottom = y - 1, y + row - 4
    return (
        f'<path class="lost" d="M{px - 4:.1f},{top} L{px + 4:.1f},{bottom} '
        f'M{px + 4:.1f},{top} L{px - 4:.1f},{bottom}" stroke="#d00" stroke-width="2.5">'
        f"<title>{tip}</title></path>"
    )


def html_report(v: Verdict, campaign: Campaign, seed: int) -> str:
    """The page: verdict, timeline (``timeline``), tables."""
    pids = sorted({c.pid for c in v.copies.values()})
    colour = colours(pids)
    names = campaign.processes
    svg = timeline(v, campaign)

    legend = " ".join(
        f'<span class="chip" style="background:{colour[p]}"></span>'
        f"{html.escape(names.get(p, '?'))} (pid {p})"
        for p in pids
    )
    lines = v.lines()
    cut = next((i for i, line in enumerate(lines) if line.startswith("history of ")), len(lines))
    findings = "".join(f"<li>{html.escape(line)}</li>" for line in lines[:cut])
    # The details after the summary: each observer's history, folded.
    histories: list[list[str]] = []
    for line in lines[cut:]:
        if line.startswith("history of "):
            histories.append([line.removesuffix(":")])
        elif histories:
            histories[-1].append(line.strip())
    details = "".join(
        f"<details class=history><summary>{html.escape(h[0])}</summary>"
        f"<pre>{html.escape(chr(10).join(h[1:]))}</pre></details>"
        for h in histories
    )
    if details:
        details = "<h2>Histories</h2>" + details
    rows = "".join(
        "<tr>"
        + "".join(
            f"<td>{html.escape(str(cell))}</td>"
            for cell in (
                kind,
                k.observers,
                k.failed,
                _downtime_cell(v, kind),
                _stop_cell(v, kind),
                len(k.ignored),
                f"{k.stalls} ({k.longest_stall:.2f}s)" if k.stalls else 0,
                _growth_cell(k.memory),
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
{details}
<h2>Timeline</h2>
<p>One row per observer (those with findings first, in red), one bar per copy from its first
witness record to its last, coloured by the process that ran it; arrow: running at the end; red
cross: LOST, where its last copy's records end; red outline: two copies at once, or a copy that
ran after its observer's delete; pink with a dashed outline: UNAVAILABLE, no copy ran for longer
than the faults explain; dashed lines: faults (hover for each).</p>
<p>{legend}</p>
<div class="scroll">{svg}</div>
<h2>Per kind</h2>
<table><tr><th>kind</th><th>observers</th><th>failed</th><th>downtime s</th>
<th>stop after cancel s (p50/p99/max)</th>
<th>ignored cancel</th><th>stalls (longest)</th><th>memory per observer</th></tr>
{rows}</table>
<h2>Outputs</h2>
{outputs}
<h2>Faults</h2>
<table class="left"><tr><th>at</th><th>fault</th><th>skipped</th></tr>{faults}</table>
</body></html>
"""
