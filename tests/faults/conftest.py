"""The fault-injection suite: every test here injects one fault (an interrupt, a tampered or
corrupt input, a forbidden option, a missing file) and checks the tool's answer. Its summary line
counts the cases."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    stats = terminalreporter.stats
    counts = {k: len([r for r in stats.get(k, []) if getattr(r, "when", "call") == "call"
                      and "tests/faults/" in getattr(r, "nodeid", "")]) for k in ("passed", "failed", "xfailed", "xpassed")}
    counts["skipped"] = len([r for r in stats.get("skipped", []) if "tests/faults/" in getattr(r, "nodeid", "")])
    counts["failed"] += len([r for r in stats.get("error", []) if "tests/faults/" in getattr(r, "nodeid", "")])
    total = sum(counts.values())
    if total:
        waiting = counts["xfailed"] + counts["xpassed"]
        terminalreporter.write_line(
            f"fault-injection suite: {total} cases, {counts['passed']} passed, {counts['failed']} failed, "
            f"{counts['skipped']} skipped" + (f", {waiting} expected to fail" if waiting else ""))
