"""Serving one configuration of `forge sweep --round final`, and keeping its server for the next one.

A configuration is served (forge serve --round final with the profile the sweep wrote for it), its tier run with
the finals' client, and its server stopped (`measure`). Two configurations that differ only in the client's
concurrency run the same server: the concurrency is the client's (CONCURRENCY_<tier>), the server's command and
environment are otherwise the same. The sweep measures such configurations one after the other (`grouped`) and
keeps the server up between them: the next one takes it over (`adopt`) where the running server is the one the
sweep kept, answers its health check, and runs exactly the command and environment the next configuration's
profile renders (the client's concurrency variables aside). The run that takes it over records the server in its
serve.json as its own profile renders it, with `server_of_run` naming the run that started it (whose folder holds
the server's log). On a DCU card a 27B server's start is minutes: a search over the client's concurrency then
pays it once per server configuration instead of once per configuration."""

from __future__ import annotations

from pathlib import Path

from .. import ui
from ..contest import profiles, rounds
from ..errors import ForgeError
from . import bench, runs, serve, server_record


def server_key(candidate: dict) -> tuple:
    """A candidate's server (a ranking entry's `candidate`): everything but the client's concurrency."""
    return tuple(sorted((k, v) for k, v in candidate.items() if k not in ("concurrency", "planned")))


def grouped(entries: list[dict]) -> list[tuple[int, dict]]:
    """The ranking's entries (1-based rank, entry) with those of one server next to each other, in the order
    their server first appears: the best-ranked configuration still runs first."""
    order: dict[tuple, list[tuple[int, dict]]] = {}
    for i, r in enumerate(entries, 1):
        order.setdefault(server_key(r["candidate"]), []).append((i, r))
    return [x for group in order.values() for x in group]


def _client_vars(rnd: rounds.Round) -> set[str]:
    return {rnd.client(t).concurrency_env for t in rnd.tier_order} - {None, ""}


def adopt(prof: Path, tier: str, run_id: str, kept: str, kw: dict, contest: dict, servers=None) -> bool:
    """Give the running server, started by the sweep for run `kept`, to run `run_id` (profile `prof`), where it
    runs what that profile renders (see the module's docstring). False (nothing written) where it does not."""
    st = server_record.running_server()
    if not st or st.get("run_id") != kept:
        return False
    if not serve.health_ok(f"http://{st['host']}:{st['port']}{st['health']}"):
        return False
    prior = Path(st["run_dir"]) / "serve.json"
    rec = runs.read_json(prior) if prior.is_file() else None
    if not isinstance(rec, dict):
        return False
    rnd = rounds.load_round(contest, "final")
    p = profiles.load_profile(str(prof), contest, rnd=rnd)
    start = servers.start_kwargs() if servers else {}
    model = Path(kw["model"]).resolve()
    rendered = serve.render(p, model, contest, rnd, tier, env=dict(start.get("process_env") or {}))
    client = _client_vars(rnd)
    same_env = ({k: v for k, v in rendered["env"].items() if k not in client}
                == {k: v for k, v in (rec.get("env") or {}).items() if k not in client})
    if (rendered["argv"] != rec.get("command") or not same_env or rec.get("model") != str(model)
            or list(start.get("harness_args") or []) != list(rec.get("harness_args") or [])):
        return False
    rdir = runs.run_dir(run_id, create=False)
    runs.refuse_other_profile(rdir, p["name"], "the server it would take over runs", hint="start a new sweep "
                              "(omit --sweep-id): this run folder was measured with another profile")
    record = {**rec, "profile": p["name"], "profile_chain": p["chain"], "description": p["description"],
              "env": rendered["env"], "server_of_run": kept, "taken_over": runs.now_iso(),
              **{k: rendered[k] for k in ("round", "tier", "settings", "sources", "tier_env") if k in rendered}}
    rdir.mkdir(parents=True, exist_ok=True)
    runs.write_json(rdir / "serve.json", record)
    runs.write_json(server_record.STATE, {**st, "run_id": run_id, "run_dir": str(rdir), "profile": p["name"]})
    ui.info(f"{run_id}: the server of run {kept} runs this configuration too (only the client's concurrency "
            "differs); kept, not restarted")
    return True


def measure(prof: Path, tier: str, run_id: str, concurrency: int, kw: dict, contest: dict,
            servers=None, kept: str | None = None, keep: bool = False) -> str:
    """Serve `prof` for `tier` (a harness sweep's servers: `servers`, this configuration's), run the tier with
    the finals' client, stop the server: the outcome. `kept`: the run whose server the sweep left up, taken
    over where it runs this configuration (`adopt`), else stopped first; `keep`: leave this server up for the
    next configuration (stopped all the same if the tier did not finish)."""
    rdir = runs.run_dir(run_id, create=False)
    if runs.tier_done(rdir, tier, keep_failed=True):
        return "measured"
    done = False
    try:
        if kept and not adopt(prof, tier, run_id, kept, kw, contest, servers):
            serve.stop_running_server()
            kept = None
        if not kept:
            log = rdir / "server.log"
            size = log.stat().st_size if log.is_file() else -1
            try:
                serve.serve_profile(str(prof), kw["model"], image=kw["image"], vllm_cmd=kw["vllm_cmd"], port=kw["port"],
                                    run_id=run_id, timeout=kw["timeout"], shm_size=kw["shm_size"], contest=contest,
                                    round_name="final", tier=tier, harness=servers)
            except ForgeError as e:
                if (log.stat().st_size if log.is_file() else -1) == size:
                    raise               # refused before a server was launched: the user's to fix, not a result
                ui.warn(f"{run_id}: the server did not start ({e.message.splitlines()[0][:200]}); recorded, not retried")
                return f"failed to start: {e.message.splitlines()[0][:300]}"
        try:
            bench.run_tiers(profile=prof.stem, run_id=run_id, model=kw["model"], data_dir=kw["data_dir"], tiers=[tier],
                            num_prompts=kw["num_prompts"], client=kw["client"], port=kw["port"], contest=contest,
                            round_name="final", concurrency={tier: concurrency}, keep_failed=True,
                            harness=kw["harness"], client_env=servers and servers.process_env)
        except ForgeError as e:
            if not runs.tier_done(rdir, tier, keep_failed=True):
                raise
            ui.warn(f"{run_id}: {e.message.splitlines()[0][:200]} (scored as measured)")
        done = True
    finally:
        if not (keep and done):
            serve.stop_running_server()
    return "measured"
