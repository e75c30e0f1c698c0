"""What ``orch verify`` reports, without servers: the timeline drawn from a verdict of synthetic
witness records, and memory growth judged from synthetic samples."""

from __future__ import annotations

import random
import uuid
import xml.etree.ElementTree as ET
from typing import Any

import pytest

from orch_contracts.witness import Record
from orch_verify.campaign import Campaign
from orch_verify.cluster import FaultCluster
from orch_verify.judge import GROWTH_FLAG, Verdict, judge, memory_growth, trend
from orch_verify.report import html_report, timeline
from tests.unit import test_verify_engine as engine

LOST, KEPT, GONE = (
    "11111111-1111-1111-1111-111111111111",
    "22222222-2222-2222-2222-222222222222",
    "33333333-3333-3333-3333-333333333333",
)
ZERO = 1_000_000.0
SVG = "{http://www.w3.org/2000/svg}"
#: ``timeline``'s geometry: the bars start this far right and are this wide in all.
LEFT, WIDTH = 300, 900


def rec(r: str, o: str | None, e: int, p: int, t: float, **detail: object) -> Record:
    return Record(r, o, e, "svc", p, ZERO + t, dict(detail))


def copy_records(o: str, epoch: int, pid: int, start: float, stop: float) -> list[Record]:
    """A copy stepping every half second from ``start`` to ``stop``."""
    steps = int((stop - start) / 0.5)
    return [rec("run", o, epoch, pid, start + 0.5 * i) for i in range(steps + 1)]


def campaign_for(kinds: dict[str, str], deleted: dict[str, int] | None = None) -> Campaign:
    campaign = Campaign(FaultCluster(env={}), 1, [], [])
    campaign.wall0 = ZERO
    campaign.processes = {10: "s1", 20: "s2", 30: "s3"}
    campaign.kinds = {uuid.UUID(o): k for o, k in kinds.items()}
    campaign.deleted = {uuid.UUID(o): e for o, e in (deleted or {}).items()}
    return campaign


def verdict_of(records: list[Record], **kw: Any) -> Verdict:
    args: dict[str, Any] = {"kinds": {LOST: "ticker", KEPT: "ticker"}, "live": {LOST, KEPT}}
    return engine.verdict_of(sorted(records, key=lambda r: r.at), **{**args, **kw})


def rows(svg: str) -> tuple[list[str], ET.Element]:
    """The labels, top to bottom, and the parsed SVG."""
    root = ET.fromstring(svg)
    labels = ["".join(t.itertext()) for t in root.iter(f"{SVG}text") if t.get("x") == "4"]
    return labels, root


def bars_of(root: ET.Element, observer: str) -> list[tuple[float, float]]:
    """(left, right) of each bar of ``observer``, by the bar's title."""
    found = []
    for r in root.iter(f"{SVG}rect"):
        title = r.find(f"{SVG}title")
        if title is not None and (title.text or "").startswith(observer):
            x, w = float(r.get("x", 0)), float(r.get("width", 0))
            found.append((x, x + w))
    return found


def at(seconds: float, end: float) -> float:
    return LEFT + WIDTH * seconds / end


def test_a_lost_observer_ends_where_its_last_copy_recorded_and_is_marked_lost() -> None:
    """LOST's only copy, in process 10, steps until 20 s and ends; KEPT runs in process 20 until
    the end (60 s). The verdict calls LOST lost; the timeline must say the same: its bar ends at
    20 s, not at the end, with a red cross there and its label in red, listed first."""
    records = [
        *copy_records(LOST, 1, 10, 0.0, 20.0),
        rec("stop", LOST, 1, 10, 20.05, x="drain"),
        rec("end", LOST, 1, 10, 20.1),
        *copy_records(KEPT, 1, 20, 0.0, 60.0),
    ]
    v = verdict_of(records)
    assert v.lost == [LOST]
    labels, root = rows(timeline(v, campaign_for(v.observer_kinds)))
    assert labels[0] == f"ticker {LOST[:8]} LOST"  # findings first
    assert labels[1] == f"ticker {KEPT[:8]}"
    lost_label = next(t for t in root.iter(f"{SVG}text") if "LOST" in "".join(t.itertext()))
    assert lost_label.get("fill") == "#c00"

    ((left, right),) = bars_of(root, LOST)
    assert left == pytest.approx(at(0.0, 60.0), abs=0.1)
    assert right == pytest.approx(at(20.0, 60.0), abs=0.1)  # its last record, not the end
    ((_, kept_right),) = bars_of(root, KEPT)
    assert kept_right == pytest.approx(at(60.0, 60.0), abs=0.1)

    (cross,) = [p for p in root.iter(f"{SVG}path") if p.get("class") == "lost"]
    xs = [
        float(v.split(",")[0])
        for v in (cross.get("d") or "").replace("M", " ").replace("L", " ").split()
    ]
    assert (min(xs) + max(xs)) / 2 == pytest.approx(at(20.0, 60.0), abs=0.1)
    tip = "".join(cross.itertext())
    assert tip.startswith("LOST: live, not running at the end")
    assert "last recorded at 20.00s" in tip
    assert "it ended at 20.10s" in tip
    # The one still running ends in an arrow; the lost one does not.
    arrows = [p for p in root.iter(f"{SVG}path") if "".join(p.itertext()) == "running at the end"]
    assert len(arrows) == 1


def test_a_lost_observer_whose_process_was_killed_stops_at_its_last_record() -> None:
    """LOST's copy was in process 30, killed at 20 s (no end record, not alive at the end): it
    never ended, but it is not running either, and its bar must not reach the end."""
    records = [*copy_records(LOST, 1, 30, 0.0, 20.0), *copy_records(KEPT, 1, 20, 0.0, 60.0)]
    v = verdict_of(records)
    assert v.lost == [LOST]
    labels, root = rows(timeline(v, campaign_for(v.observer_kinds)))
    assert labels[0].endswith("LOST")
    ((_, right),) = bars_of(root, LOST)
    assert right == pytest.approx(at(20.0, 60.0), abs=0.1)
    (cross,) = [p for p in root.iter(f"{SVG}path") if p.get("class") == "lost"]
    assert "its process was gone at the end" in "".join(cross.itertext())


def test_a_lost_observer_that_never_ran_still_has_its_row_and_mark() -> None:
    v = verdict_of(copy_records(KEPT, 1, 20, 0.0, 60.0))
    assert v.lost == [LOST]
    labels, root = rows(timeline(v, campaign_for(v.observer_kinds)))
    assert labels == [f"ticker {LOST[:8]} LOST", f"ticker {KEPT[:8]}"]
    assert bars_of(root, LOST) == []
    (cross,) = [p for p in root.iter(f"{SVG}path") if p.get("class") == "lost"]
    assert "never recorded a step" in "".join(cross.itertext())


def test_a_short_last_copy_is_drawn_up_to_its_last_record_not_past_it() -> None:
    """A copy of one record is still drawn (2 px wide), ending where the record is."""
    records = [rec("run", LOST, 1, 10, 30.0), *copy_records(KEPT, 1, 20, 0.0, 60.0)]
    v = verdict_of(records, alive={20})
    _, root = rows(timeline(v, campaign_for(v.observer_kinds)))
    ((left, right),) = bars_of(root, LOST)
    assert right == pytest.approx(at(30.0, 60.0), abs=0.1)
    assert right - left == pytest.approx(2.0, abs=0.1)


def test_a_copy_that_ran_after_its_delete_is_marked() -> None:
    """GONE was deleted at epoch 1; epoch 2 ran after that: outlined in red, labelled."""
    kinds = {KEPT: "ticker", GONE: "ticker"}
    records = [
        *copy_records(GONE, 1, 10, 0.0, 10.0),
        rec("end", GONE, 1, 10, 10.1),
        *copy_records(GONE, 2, 20, 12.0, 30.0),
        rec("end", GONE, 2, 20, 30.1),
        *copy_records(KEPT, 1, 20, 0.0, 60.0),
    ]
    v = verdict_of(records, kinds=kinds, live={KEPT}, deleted={GONE: 1})
    assert v.ran_after_delete == [GONE]
    labels, root = rows(timeline(v, campaign_for(kinds, {GONE: 1})))
    assert labels[0] == f"ticker {GONE[:8]} RAN AFTER DELETE"
    outlined = [
        "".join(r.itertext())
        for r in root.iter(f"{SVG}rect")
        if r.get("stroke") == "#d00" and r.get("fill") != "none"
    ]
    assert len(outlined) == 1
    assert "epoch 2" in outlined[0]
    assert "ran after its observer was deleted" in outlined[0]


def test_the_page_carries_the_timeline_and_the_verdict() -> None:
    records = [*copy_records(LOST, 1, 30, 0.0, 20.0), *copy_records(KEPT, 1, 20, 0.0, 60.0)]
    v = verdict_of(records)
    page = html_report(v, campaign_for(v.observer_kinds), 1)
    assert "<title>orch verify, seed 1: failed</title>" in page
    assert 'class="lost"' in page
    assert f"LOST ticker {LOST}: live, not running at the end" in page


def test_the_page_gives_the_summary_first_and_each_history_folded() -> None:
    records = [*copy_records(LOST, 1, 30, 0.0, 20.0), *copy_records(KEPT, 1, 20, 0.0, 60.0)]
    v = verdict_of(records)
    v.history[LOST] = ["0.10s created epoch None", "0.20s taken epoch 1 s1"]
    page = html_report(v, campaign_for(v.observer_kinds), 1)
    summary = page.index(f"<li>LOST ticker {LOST}")
    folded = page.index(
        f"<details class=history><summary>history of ticker {LOST}</summary>"
        "<pre>0.10s created epoch None\n0.20s taken epoch 1 s1</pre></details>"
    )
    assert summary < folded < page.index("<h2>Timeline</h2>")
    assert "<li>history of" not in page
    assert "<li>  0.10s" not in page


# ------------------------------------------------------------------ memory growth

KIB = 1024


def mem(
    series: list[tuple[float, float]], kind: str = "k", pid: int = 10, n: int = 2
) -> list[Record]:
    """Samples of ``kind`` in process ``pid`` (bytes per observer at each time), after a first
    record at 0 that starts the warm-up."""
    first = [rec("run", LOST, 1, pid, 0.0)]
    return first + [rec("mem", None, 0, pid, t, k=kind, b=v * n, n=n) for t, v in series]


def every_5s(seconds: float, value: Any, start: float = 10.0) -> list[tuple[float, float]]:
    return [(start + 5 * i, value(5 * i)) for i in range(int(seconds / 5) + 1)]


def test_a_flat_series_with_noise_is_no_growth() -> None:
    """A trivial kind: 3 KiB per observer give or take 2 KiB of allocator noise, for 3 min,
    and a short run of the same: neither is near the flag, let alone over it."""
    rng = random.Random(7)
    for seconds in (25, 60, 180):
        for seed in range(50):
            rng.seed(seed)
            g = memory_growth(mem(every_5s(seconds, lambda _: 3 * KIB + rng.uniform(-2, 2) * KIB)))
            assert not g["k"].flagged
            assert g["k"].rate < GROWTH_FLAG / 4, (seconds, seed, g)


def test_a_one_off_step_is_no_growth() -> None:
    """A buffer of 200 KiB per observer taken once, a minute in, and kept: it grew, but not
    all along (a least-squares slope over the same samples is 144 KiB a minute)."""
    samples = every_5s(120, lambda s: 4 * KIB + (200 * KIB if s >= 60 else 0))
    g = memory_growth(mem(samples))["k"]
    assert g.grown == pytest.approx(200 * KIB)
    assert g.rate == pytest.approx(0.0)
    assert not g.flagged
    v = judge(mem(samples), **VERDICT_ARGS)
    assert not v.kinds["k"].grows
    assert not any(line.startswith("MEMORY GROWTH") for line in v.lines())


def test_a_steady_leak_is_growth_and_flagged() -> None:
    """100 KiB per observer per minute, with noise: flagged once it has grown 64 KiB."""
    rng = random.Random(1)
    samples = every_5s(180, lambda s: 3 * KIB + 100 * KIB * s / 60 + rng.uniform(-2, 2) * KIB)
    g = memory_growth(mem(samples))["k"]
    assert g.rate == pytest.approx(100 * KIB, rel=0.1)
    assert g.flagged
    v = judge(mem(samples), **VERDICT_ARGS)
    assert v.kinds["k"].grows
    (line,) = [line for line in v.lines() if line.startswith("MEMORY GROWTH k")]
    assert "KiB per observer per minute" in line
    assert "your kind `k` keeps growing in memory" in v.verdict_line()
    kind = v.as_dict()["kinds"]["k"]
    assert kind["memory_grows"] is True
    assert kind["memory_growth_bytes_per_observer_per_minute"] > GROWTH_FLAG


def test_a_growth_just_over_the_flag_is_judged_only_over_a_long_enough_window() -> None:
    """80 KiB per observer per minute: 30 s of it is 40 KiB, as much as noise or a buffer
    could be, and is not flagged; 2 min of it is 160 KiB, and is."""
    leak = every_5s(30, lambda s: 80 * KIB * s / 60)
    short = trend(leak)
    assert short.rate > GROWTH_FLAG
    assert not short.flagged
    assert trend(every_5s(120, lambda s: 80 * KIB * s / 60)).flagged
    # A fast leak needs no more than the shortest window judged.
    assert trend(every_5s(20, lambda s: 10_000 * KIB * s / 60)).flagged


def test_too_few_samples_or_too_short_a_span_are_not_judged() -> None:
    assert memory_growth(mem(every_5s(10, lambda s: 1000 * KIB * s))) == {}
    assert memory_growth(mem([(10.0, 0.0), (30.0, 1000 * KIB)])) == {}
    # Samples in the warm-up are left out.
    assert memory_growth(mem(every_5s(20, lambda s: 1000 * KIB * s, start=0.0))) == {}
    assert memory_growth(mem(every_5s(15, lambda s: 1000 * KIB * s)))["k"].flagged


def test_the_kind_is_judged_where_it_grew() -> None:
    """A kind that leaks in one process and not in another is flagged, with that process's
    figure."""
    flat = mem(every_5s(120, lambda _: 3 * KIB), pid=20)
    leaking = mem(every_5s(120, lambda s: 200 * KIB * s / 60), pid=10)
    g = memory_growth(sorted(flat + leaking, key=lambda r: r.at))["k"]
    assert g.flagged
    assert g.rate == pytest.approx(200 * KIB)


VERDICT_ARGS: dict[str, Any] = {
    "kinds": {LOST: "k"},
    "live": {LOST},
    "deleted": {},
    "failed": {},
    "restarts": [],
    "alive": {10},
    "shutdown_timeout": 5.0,
}


def test_the_table_shows_each_kinds_growth_and_what_it_grew_by() -> None:
    from rich.console import Console

    from orch_verify.report import table

    rng = random.Random(3)
    leak = every_5s(180, lambda s: 100 * KIB * s / 60 + rng.uniform(-2, 2) * KIB)
    records = mem(leak) + mem(every_5s(180, lambda _: 3 * KIB), kind="flat", pid=20)
    v = judge(
        sorted(records, key=lambda r: r.at), **{**VERDICT_ARGS, "kinds": {LOST: "k", KEPT: "flat"}}
    )
    console = Console(width=200, record=True, color_system=None)
    console.print(table(v))
    lines = console.export_text().splitlines()
    leaking = next(line for line in lines if line.startswith("│ k "))
    flat = next(line for line in lines if line.startswith("│ flat "))
    assert "KiB/min (+" in leaking
    assert "KiB in 180s)" in leaking
    assert "flat (+0 KiB in 180s)" in flat


def test_every_process_has_a_colour_of_its_own() -> None:
    from orch_verify.report import colours

    shown = colours(list(range(40)))
    assert len(set(shown.values())) == 40
