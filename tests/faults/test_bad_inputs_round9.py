"""Runs reported as a success that were not one, found in the fourth round of input hardening.

`forge e2e-gpu`, a server that dies in the middle of a tier (or is gone when the next tier begins): the client's
run fails, the tier is recorded with every request failed and scored so, and the run exited 0, the failures
visible only as zeros in the summary. It now exits 1 naming each (tier, profile) whose server went away and the
server's log; what the other profile measured is kept, and the next invocation of the same folder runs only
the tiers that failed.

`forge serve --dry-run` without a model folder: its help says the folder is not looked at, yet it refused "no
model directory given". It now prints the checked command with the start script's own `$MODEL_DIR` in the
folder's place, and a real start still refuses.
"""

from __future__ import annotations

import json

from helpers import e2e_fake, forge, free_port_pair
from test_bad_inputs_round5 import fix_line


def test_a_server_that_dies_mid_tier_fails_the_run_naming_each_tier_and_its_log(tmp_path):
    port = free_port_pair()
    kill = {"FAKE_EXIT_ROUTE": "1", "REPLAY_KILL_PORT": str(port + 1)}       # upstream's server, the second port
    r, port, out = e2e_fake(tmp_path, "--no-fault", "--tier-order", "4-8K,8-16K", port=port, env_extra=kill)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    err = [x for x in r.stderr.splitlines() if x.startswith("forge e2e-gpu: error: ")]
    assert len(err) == 1 and "Traceback" not in r.stderr, r.stderr
    log = out / "runs" / "upstream" / "server.log"
    assert "2 (tier, profile) run(s) failed and are not measured" in err[0], err
    assert f"tier 4-8K of upstream: its server died during the tier (every request of the tier is recorded " \
           f"as failed); its log: {log}" in err[0], err
    assert "tier 8-16K of upstream: its server was not answering when the tier began" in err[0], err
    assert "fast-int8" not in err[0], err
    assert "exiting as told" in log.read_text()
    assert "run the same --out again" in fix_line(r)
    for tier in ("4-8K", "8-16K"):
        dead = json.loads((out / "runs" / "upstream" / f"{tier}.json").read_text())
        assert dead["failed"] == 1 and dead["completed"] == 0, dead
        kept = json.loads((out / "runs" / "fast-int8" / f"{tier}.json").read_text())
        assert kept["completed"] >= 1 and not kept.get("forge_synthesized"), kept
    s = json.loads(out.joinpath("summary.json").read_text())
    assert s["error"] in err[0]
    calls = len((tmp_path / "replay.log").read_text().splitlines())

    # the next invocation of the folder, the server healthy: only upstream's two tiers run, and it succeeds
    r2, _, _ = e2e_fake(tmp_path, "--no-fault", "--tier-order", "4-8K,8-16K", port=port)
    assert r2.returncode == 0, r2.stdout[-2000:] + r2.stderr[-2000:]
    again = [json.loads(x) for x in (tmp_path / "replay.log").read_text().splitlines()[calls:]]
    ports = {a["argv"][a["argv"].index("--port") + 1] for a in again}
    assert sorted(a["tier"] for a in again) == ["4-8K", "8-16K"] and ports == {str(port + 1)}, again
    for tier in ("4-8K", "8-16K"):
        assert json.loads((out / "runs" / "upstream" / f"{tier}.json").read_text())["completed"] >= 1
    assert "error" not in json.loads(out.joinpath("summary.json").read_text())


def test_a_dry_run_needs_no_model_folder_and_a_start_still_does(tmp_path):
    for rnd in ([], ["--round", "final", "--tier", "16-32K"]):
        r = forge(tmp_path, "serve", "--profile", "contest", "--dry-run", *rnd)
        assert r.returncode == 0, r.stderr
        assert "serve '$MODEL_DIR' --served-model-name Qwen3.5-27B" in r.stdout, r.stdout
        assert "# no --model: '$MODEL_DIR' stands for the model folder" in r.stdout, r.stdout
    r = forge(tmp_path, "serve", "--profile", "contest", "--no-wait")
    assert r.returncode == 2 and "no model directory given" in r.stderr, r.stderr
