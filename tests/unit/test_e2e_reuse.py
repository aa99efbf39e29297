"""Whole `forge e2e-gpu` runs against two fake servers and the replay client: one client invocation per
(tier, profile) over all the tier's prompts, with the organizers' options changed only as the run
records; servers left up with --keep-servers reused by the next invocation of the folder (and not
when they run another command or have died), stopped by --stop-servers."""

import json
import os
import shlex
import signal
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))
from helpers import e2e_fake, forge, health  # noqa: E402

from forge import proc  # noqa: E402
from forge.contest import rules as contest  # noqa: E402
from forge.lab import tiers  # noqa: E402


def options(argv: list[str]) -> dict:
    out, i = {}, 0
    while i < len(argv):
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out[argv[i]] = argv[i + 1]
            i += 2
        else:
            out[argv[i]] = None
            i += 1
    return out


def test_one_client_invocation_per_tier_and_profile_over_all_its_prompts(tmp_path):
    r, port, out = e2e_fake(tmp_path, "--no-fault", "--no-plumbing", "--num-prompts", "3")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    calls = [json.loads(x) for x in (tmp_path / "replay.log").read_text().splitlines()]
    # tiers in order, the profiles one after the other within a tier, each (tier, profile) once
    got = [(c["tier"], c["argv"][c["argv"].index("--port") + 1]) for c in calls]
    assert got == [(t, str(p)) for t in tiers.DEFAULT_TIER_ORDER for p in (port, port + 1)]
    c = contest.load_contest()
    theirs = options(shlex.split(c["client"]["command"])[3:])
    changes = {}
    for d in s["differences"]:
        if d["side"] == "client":
            changes.update(options(d["args"]))
    for call in calls:
        a = call["argv"]
        o = options(a[2:])
        assert o["--num-prompts"] == "3"
        lines = Path(o["--dataset-path"]).read_text().splitlines()
        assert [json.loads(x)["output_tokens"] for x in lines] == [o for _, o in s["datasets"][call["tier"]]["requests"]]
        # the organizers' options, changed exactly as the run records it
        assert {k: v for k, v in o.items() if k not in tiers.FILLED_IN} == \
            {**{k: v for k, v in theirs.items() if k not in tiers.FILLED_IN}, **changes}
    # the manifests say exactly what ran: the client line, and each tier's full command
    for name, p in (("fast-int8", port), ("upstream", port + 1)):
        m = json.loads((out / "runs" / name / "manifest.json").read_text())
        assert m["client"] == s["client"] and m["differences"] == s["differences"]
        assert m["tiers"] == ["4-8K", "8-16K", "16-32K"]
        for call in calls:
            if call["argv"][call["argv"].index("--port") + 1] == str(p):
                assert shlex.split(m["client_commands"][call["tier"]])[-len(call["argv"]):] == call["argv"]
        # and the server ran the organizers' command with the recorded server changes
        serve = json.loads((out / "runs" / name / "serve.json").read_text())
        launched = options(serve["launch"][serve["launch"].index("serve") + 2:])
        listed = {}
        for d in s["differences"]:
            if d["side"] == "server" and (d["args"][0] != "--port" or d["args"][1] == str(p)):
                listed.update(options(d["args"]))
        assert launched == {**options(serve["command"][3:]), **listed}
        assert "--compilation-config" not in launched
    md = (out / "summary.md").read_text()
    assert "## Differences from the organizers' command" in md and "| client | `--ignore-eos` |" in md


def _state(out: Path, name: str) -> dict:
    return json.loads((out / "state" / f"{name}.json").read_text())


def _alive(st: dict) -> bool:
    return proc.process_start_time(st["pid"]) == st["start_time"]


def test_servers_left_up_are_reused_by_the_next_invocation_of_the_folder(tmp_path):
    args = ("--no-fault", "--no-plumbing")
    r, port, out = e2e_fake(tmp_path, *args, "--tier-order", "4-8K", "--keep-servers")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    first = {n: _state(out, n) for n in ("fast-int8", "upstream")}
    assert all(_alive(st) for st in first.values()) and health(port) and health(port + 1)
    assert "servers left up (--keep-servers)" in r.stderr + r.stdout
    assert json.loads((out / "summary.json").read_text())["servers_left_up"]["upstream"]["port"] == port + 1
    # the pack holds results, not the machine's state of its live servers
    names = tarfile.open(tmp_path / "pack" / "e2e.tgz").getnames()
    assert "out/summary.json" in names and not any("/state/" in n for n in names)
    # upstream's server dies between the invocations: it is started again, fast-int8's is reused
    os.killpg(first["upstream"]["pgid"], signal.SIGKILL)
    r, port, out = e2e_fake(tmp_path, *args, "--keep-servers", port=port)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    steps = [x["step"] for x in s["steps"]]
    assert f"server fast-int8 reused: left up by an earlier invocation (pid {first['fast-int8']['pid']}, port {port})" \
        in steps
    assert "server fast-int8 ready" not in steps and "server upstream ready" in steps
    assert "tier 4-8K fast-int8: kept from an earlier invocation" in steps
    assert _state(out, "fast-int8")["pid"] == first["fast-int8"]["pid"]
    second = {n: _state(out, n) for n in ("fast-int8", "upstream")}
    assert all(_alive(st) for st in second.values())
    # the reused server's log is the one it was started with: one start in it
    log = (out / "runs" / "fast-int8" / "server.log").read_text()
    assert log.count("fakeserver: listening") == 1
    # another command (here the kernel cache the servers are given) is not reused: both stopped, and
    # both started again for a tier left to measure
    for f in (out / "runs").glob("*/16-32K*"):
        f.unlink()
    r, port, out = e2e_fake(tmp_path, *args, "--triton-cache", str(tmp_path / "tc"), port=port)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "it runs another command than this invocation's" in r.stderr + r.stdout
    steps = [x["step"] for x in json.loads((out / "summary.json").read_text())["steps"]]
    assert "server fast-int8 ready" in steps and "server upstream ready" in steps
    assert not any("reused" in x for x in steps)
    # without --keep-servers the invocation stopped its servers at its end
    assert not any(_alive(st) for st in second.values())
    assert not health(port) and not health(port + 1) and not list((out / "state").glob("*.json"))


def test_stop_servers_stops_what_keep_servers_left_up(tmp_path):
    r, port, out = e2e_fake(tmp_path, "--no-fault", "--no-plumbing", "--tier-order", "4-8K", "--keep-servers")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    sts = [_state(out, n) for n in ("fast-int8", "upstream")]
    assert all(_alive(st) for st in sts)
    r = forge(tmp_path, "e2e-gpu", "--stop-servers", "--out", str(out))
    assert r.returncode == 0 and "2 server(s) stopped" in r.stderr + r.stdout, r.stderr
    assert not any(_alive(st) for st in sts) and not health(port) and not health(port + 1)
    assert not list((out / "state").glob("*.json"))
    r = forge(tmp_path, "e2e-gpu", "--stop-servers")
    assert r.returncode == 2 and "--stop-servers needs --out" in r.stderr and "Traceback" not in r.stderr


def test_a_folder_of_the_earlier_round_layout_is_refused_before_anything_runs(tmp_path):
    import shutil

    from helpers import h200_e2e
    out = tmp_path / "out"
    shutil.copytree(h200_e2e() / "2026-11-30-h200-contest", out)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    r, port, out = e2e_fake(tmp_path, "--profiles", "contest,upstream")
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "a folder of an earlier harness" in r.stderr and "Traceback" not in r.stderr
    assert not health(port) and not (tmp_path / "replay.log").exists()
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def _files(root: Path) -> dict:
    """Every file under `root` and its bytes and time, but the live servers' own logs (a /health check adds a line)."""
    return {str(p): (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != "server.log"}


def test_a_deadline_that_holds_no_tier_is_refused_when_every_server_is_reused(tmp_path):
    """Every server the invocation needs is left up by an earlier one: no start is counted, but the shortest tier
    still to measure (8-16K for both profiles, guessed well over 30 s) and the reserve must still fit --deadline-s.
    Refused before anything is written, with or without --keep-servers, the servers left up as they were (before,
    the check was skipped: the servers were adopted and every tier skipped)."""
    args = ("--no-fault", "--no-plumbing")
    r, port, out = e2e_fake(tmp_path, *args, "--tier-order", "4-8K", "--keep-servers")
    try:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        up = {n: _state(out, n) for n in ("fast-int8", "upstream")}
        before = {**_files(out), **_files(tmp_path / "pack")}
        for keep in (("--keep-servers",), ()):
            r, port, out = e2e_fake(tmp_path, *args, "--tier-order", "4-8K,8-16K", "--deadline-s", "30", "--reserve-s",
                                    "0", *keep, port=port)
            assert r.returncode == 2, (keep, r.stdout[-3000:] + r.stderr[-3000:])
            assert "no tier would be measured" in r.stderr and "the shortest tier left, 8-16K, for fast-int8, upstream" \
                in r.stderr and "reused" in r.stderr and "Traceback" not in r.stderr, r.stderr
            assert {**_files(out), **_files(tmp_path / "pack")} == before, keep
            assert all(_alive(st) for st in up.values()) and health(port) and health(port + 1)
    finally:
        forge(tmp_path, "e2e-gpu", "--stop-servers", "--out", str(out))
    assert not health(port) and not health(port + 1)
