"""The tier-time guess against every recorded final-round tier: `forge e2e-gpu` starts a tier only where its
guess fits the time left, so a guess below the real time runs a tier past the deadline (the GPU machine's
command limit ends it mid-tier) and one far above skips a tier that fitted (2026-12-06-h100-final-calibrated:
upstream's 16-32K tier, guessed 206 s with 189 s left, takes about 125 s). Each tier of reports/e2e/*/raw.tgz run
with the final round's client that did not preempt (a preempting server is what the measured-over-guessed scale
corrects, after the first tier) must fall inside the band below."""

from __future__ import annotations

import json
import re
import tarfile
from pathlib import Path

from forge.lab import tierguess

ROOT = Path(__file__).resolve().parents[2]
LOW, HIGH = 1.1, 1.8        # guess over measured: a tenth of margin at least, and not twice the time


def recorded_tiers() -> list[tuple[str, str, str, int, list, float]]:
    out = []
    for raw in sorted((ROOT / "reports" / "e2e").glob("*/raw.tgz")):
        with tarfile.open(raw) as tf:
            for m in tf.getmembers():
                if not m.name.endswith("summary.json"):
                    continue
                s = json.load(tf.extractfile(m))
                cmd = s.get("command", "")
                if "--round final" not in cmd or "--finals-servers" in cmd:
                    continue
                caps = dict(re.findall(r"--capacity (\S+?):max-num-seqs=(\d+)", cmd))
                conc = int((re.findall(r"--concurrency (\d+)", cmd) or ["10"])[-1])
                for st in s.get("steps", []):
                    hit = re.match(r"tier (\S+) (\S+): [\d.]+ tok/s", st.get("step", ""))
                    if not hit or not st.get("seconds") or st.get("preemptions") or st.get("status") != "done":
                        continue
                    tier, profile = hit.groups()
                    inflight = min(conc, int(caps.get(profile, 128)))
                    out.append((raw.parent.name, tier, profile, inflight, s["datasets"][tier]["requests"],
                                float(st["seconds"])))
    return out


def test_the_guess_holds_every_recorded_final_round_tier_within_its_band():
    tiers = recorded_tiers()
    assert len(tiers) >= 10, "the recorded final-round runs are in reports/e2e"
    assert {t[3] for t in tiers} >= {4, 5, 7, 10}, "tiers at several counts in flight"
    off = []
    for run, tier, profile, inflight, requests, seconds in tiers:
        ratio = tierguess.guess_s(requests, 2, inflight) / seconds
        if not LOW <= ratio <= HIGH:
            off.append(f"{run} {tier} {profile} ({inflight} in flight): guess {ratio:.2f}x the measured {seconds:.0f} s")
    assert not off, off
