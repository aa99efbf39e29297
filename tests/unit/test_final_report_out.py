"""`forge report --round final` (make report ROUND=final) writes the final round's documents beside the
tier-environment file (reports/final-round/), never over the preliminary's tracked reports/*.md, which
the default `forge report` keeps current."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))
from helpers import ROOT, forge  # noqa: E402

DOCS = ["env-vars.md", "optimization-plan.md", "submission-readme.md", "submission/ENVIRONMENT.md",
        "submission/OPTIMIZATION.md"]


def test_the_final_rounds_report_goes_beside_its_tier_environment(tmp_path):
    before = {d: (ROOT / "reports" / d).read_bytes() for d in DOCS}
    r = forge(tmp_path, "report", "--round", "final")      # FORGE_RUNS_DIR=tmp/runs: final-round/ is tmp's
    assert r.returncode == 0, r.stderr
    out = tmp_path / "final-round"
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*.md")) == sorted(DOCS)
    assert "## The final round: the environment per tier" in (out / "submission" / "ENVIRONMENT.md").read_text()
    assert "--tensor-parallel-size 2 --data-parallel-size 1" in (out / "env-vars.md").read_text()
    assert {d: (ROOT / "reports" / d).read_bytes() for d in DOCS} == before
    assert "reports/env-vars.md" not in r.stderr
    r = forge(tmp_path, "report", "--help")
    assert "final-round/" in r.stdout
