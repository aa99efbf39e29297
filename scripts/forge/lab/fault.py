"""The fault check: kill a server while a tier's request is in flight and check that the bench loop
records the failure and the score zeroes the tiers."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .. import proc
from ..errors import ForgeError
from ..run import bench, runs, score, serve
from .client import client_runner
from .tiers import fault_datasets

if TYPE_CHECKING:
    from .session import Run


def fault_check(run: Run, name: str, model: Path, datasets: dict) -> dict:
    """Kill `name`'s server while a tier's first request is in flight (with the organizers' client,
    that is its first warm-up), then let the loop go on: the tier's request must be recorded failed,
    the tiers after it failed without waiting, and the score must zero them all."""
    st = run.servers[name]
    health = f"http://{st['host']}:{st['port']}{st['health']}"
    if not serve.health_ok(health):
        raise ForgeError(f"fault check: the {name} server was already down before the check")
    contest_h = run.contest_h             # the tiers' own client, warm-ups included
    tiers = run.contest["tiers"]
    one = fault_datasets(run, datasets)
    rid = f"fault-{name}"
    rdir = run.run_dir(rid)
    for old in rdir.glob("*.json"):
        old.unlink()
    man = {"run_id": rid, "profile": name, "fault_check": True, "harness": True}
    launcher = bench.client_launcher(run.args.client)
    statuses: dict = {}
    server_log = Path(st["log"])
    posts_before = server_log.read_text(errors="replace").count("POST /v1/chat/completions")
    stop = threading.Event()

    def killer():
        # wait until the server has taken the tier's request (its access log shows the POST), then
        # kill the server's whole process group while the reply is streaming
        t = time.monotonic()
        while time.monotonic() - t < 60 and not stop.is_set():
            if server_log.read_text(errors="replace").count("POST /v1/chat/completions") > posts_before:
                break
            time.sleep(0.2)
        if stop.wait(run.args.fault_delay_s):
            return
        if proc.process_start_time(st["pid"]) == st["start_time"]:      # still our server
            proc.kill_group(st["pgid"])
            statuses["killed_at_s"] = round(time.monotonic() - t, 1)

    k = threading.Thread(target=killer, daemon=True)
    k.start()
    try:
        for t in tiers:
            ds = {"kind": "synthetic", "path": str(one[t["name"]]), "num_prompts": 1}
            statuses[t["name"]] = bench.run_tier(contest_h, t, ds, launcher=launcher, model=str(model),
                                                 host=st["host"], port=st["port"], rdir=rdir, manifest=man,
                                                 health_url=health, poll_s=30, runner=client_runner(run),
                                                 env=run.child_env)
    finally:
        stop.set()
        k.join(timeout=5)
    if st.get("popen") is not None:
        st["popen"].poll()                # reap our own child
    res = {t["name"]: runs.read_json(runs.result_path(rdir, t["name"])) for t in tiers}
    ref_dir = run.run_dir(name)
    verdict = {}
    if all(runs.result_path(ref_dir, t["name"]).is_file() for t in tiers):
        base = score.baseline_from_run(ref_dir, run.contest)
        if all(m["tok_s"] > 0 for m in base["tiers"].values()):
            base["label"] = f"{name} measured in this run, before the fault (H200 proxy: {name} = 60.0)"
            loaded = score.load_run(rdir, run.contest)
            sc, _ = score.write_report(run.contest, rdir, loaded, base, score.output_drift(loaded, base),
                                       shown=str(rdir.relative_to(run.out)))
            verdict = {n: {"contribution": t["contribution"], "zeroed_by": t["zeroed_by"]}
                       for n, t in sc["tiers"].items()}
    first = tiers[0]["name"]
    ok = ("killed_at_s" in statuses and statuses[first] in ("done", "server-died")
          and all((r.get("failed") or 0) >= 1 and not r.get("completed") for r in res.values())
          and all(statuses[t["name"]] == "server-down" for t in tiers[1:])
          and (not verdict or all(v["contribution"] == 0 for v in verdict.values())))
    return {"server": name, "statuses": statuses,
            "failed": {n: r.get("failed") for n, r in res.items()},
            "completed": {n: r.get("completed") for n, r in res.items()},
            "score": verdict, "ok": ok}
