"""`forge serve` / `forge stop`: start the organizers' server command (their start script) with a
profile's environment (in the image or from the installed wheel), wait until it answers /health, and stop exactly the server we started
(its record, and whether it is still that server: server_record)."""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from .. import options, paths, proc, ui
from ..contest import profiles, rounds, unread
from ..contest import rules as contest_mod
from ..errors import ForgeError
from . import gpu_harness, runs, server_record, serverlog
from .serve_headroom import say_headroom
from .serverlog import KNOWN_FAILURES, diagnose  # noqa: F401  (serve's API since before they moved)

render = profiles.render_checked          # the server command of a profile in a round, its cards checked
LOCKED_PORT = serverlog.SCORED_PORT

# Device access for the DCU container (contest-facts: /dev/kfd, /dev/mkfd, /dev/dri, /opt/hyhal ro,
# group video, large shm, host IPC).
DOCKER_DEVICE_ARGS = ["--device=/dev/kfd", "--device=/dev/mkfd", "--device=/dev/dri",
                      "-v", "/opt/hyhal:/opt/hyhal:ro", "--group-add", "video", "--ipc=host",
                      "--network=host"]

def _env_or(value: str | None, var: str) -> str | None:
    return value or (os.environ.get(var) or None)


def check_image(image: str | None) -> None:
    """--image (else $IMAGE): docker has it, asked before a run folder or a sweep's record is written (a missing
    one failed only as its container started, after them)."""
    image = _env_or(image, "IMAGE")
    if not image:
        return
    if not shutil.which("docker"):
        raise ForgeError(f"--image {image}: docker is not on this machine's PATH, so no container can start",
                         hint="install docker, or leave --image (and $IMAGE) out to serve from the installed wheel")
    r = proc.run(["docker", "image", "inspect", "--format", "{{.Id}}", image], check=False, capture=True, timeout=60)
    if r.returncode != 0:
        said = [x.strip() for x in (r.stderr or r.stdout or "").splitlines() if x.strip()]
        why = said[-1] if said else f"exit {r.returncode}"
        if "no such image" not in why.lower():          # the daemon down, no permission: not the image's fault
            raise ForgeError(f"--image {image}: docker could not say whether it has the image ({why})",
                             hint="start the docker daemon or add the user to the docker group, then run it again")
        raise ForgeError(f"--image {image}: docker has no such image ({why})",
                         hint="build it (make image) or pull it first; `docker images` lists this machine's images")


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def health_ok(url: str, timeout: float = 2.0) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def native_launcher(vllm_cmd: str | None) -> list[str]:
    if vllm_cmd is not None:
        return proc.split_command(vllm_cmd, "--vllm")
    if shutil.which("vllm"):
        return ["vllm"]
    return [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def launch_command(rendered: dict, *, image: str | None, vllm_cmd: str | None, port: int,
                   container: str, shm_size: str) -> list[str]:
    argv = list(rendered["argv"])
    if port != LOCKED_PORT:
        i = argv.index("--port")
        argv[i + 1] = str(port)
    if image:
        model = rendered["model"]
        cmd = ["docker", "run", "--rm", "--name", container, *DOCKER_DEVICE_ARGS, f"--shm-size={shm_size}",
               "-v", f"{model}:{model}:ro"]
        for k, v in rendered["env"].items():
            cmd += ["-e", f"{k}={v}"]
        # the image's own entrypoint is `forge serve --foreground`; here the rendered command runs as is
        return cmd + ["--entrypoint", argv[0], image, *argv[1:]]
    return native_launcher(vllm_cmd) + argv[1:]


def serve_profile(profile: str, model: str | None = None, *, image: str | None = None, vllm_cmd: str | None = None,
                  port: int | None = None, run_id: str | None = None, timeout: float = 1800,
                  shm_size: str = "64g", wait: bool = True, contest: dict | None = None,
                  round_name: str | None = None, tier: str | None = None,
                  harness: gpu_harness.Servers | None = None) -> dict:
    """Start the server of a profile (configs/serve/<profile>.yaml, checked against the contest's
    rules) from the installed wheel, through `vllm_cmd`, or in `image`; record it for `forge stop`
    and, with `wait`, return once /health answers. Returns the server's state (run_id, port, ...).
    `round_name` (default: the preliminary) and, for the final round, `tier`: the round's start script
    with that tier's values (forge.contest.rounds). `harness`: a GPU harness server (gpu_harness.Servers)."""
    contest = contest or contest_mod.load_contest()
    rnd = rounds.load_round(contest, round_name or rounds.DEFAULT_ROUND)
    prof = profiles.load_profile(profile, contest, rnd=rnd)
    model = _env_or(model, "MODEL")
    image = _env_or(image, "IMAGE")
    if not model:
        raise ForgeError("no model directory given", hint="pass --model DIR (make serve MODEL=DIR)")
    rendered = render(prof, Path(model), contest, rnd, tier)     # a round's values and its cards, before anything else
    if harness is None:                  # a harness server's KV cache is fixed in bytes: the utilization is not read
        say_headroom(rendered, rnd)
    check_image(image)
    _say_unread(contest, rnd)
    port = port or LOCKED_PORT
    run_id = runs.check_run_id(run_id) if run_id is not None else runs.new_run_id(prof["name"])
    if vllm_cmd is not None:
        native_launcher(vllm_cmd)                 # an unbalanced quote is refused before anything starts
    if not image and vllm_cmd is None and not shutil.which("vllm"):
        probe = proc.run([sys.executable, "-c", "import vllm"], check=False, capture=True,
                         env=harness.process_env if harness else None)
        if probe.returncode != 0:
            raise ForgeError("vLLM is not installed for this Python and no image was given",
                             hint="install our wheel (pip install dist/vllm-*.whl) or pass --image IMAGE")
    st = server_record.running_server()
    if st:
        raise ForgeError(f"a server started by forge is already running (pid {st['pid']}, run {st['run_id']})",
                         hint="forge stop (make stop) first")
    state = start_server(prof, Path(model).resolve(), contest=contest, port=port, run_id=run_id, image=image,
                         vllm_cmd=vllm_cmd, shm_size=shm_size, wait=wait, timeout=timeout, rnd=rnd, tier=tier,
                         **(harness.start_kwargs() if harness else {}))
    if state.get("ready"):
        ui.info(f"server ready on http://{state['host']}:{port} (run {run_id}); `forge stop` ends it")
    return state


def stop_running_server() -> str:
    """Stop the server `serve_profile` (or `forge serve`) started, if any; returns what happened."""
    st = server_record.read_state()
    if st is None:
        ui.info("no server started by forge is recorded; nothing to stop")
        return "none recorded"
    if not server_record.still_ours(st):
        server_record.STATE.unlink(missing_ok=True)
        ui.info(f"the recorded server (pid {st['pid']}, run {st['run_id']}) {proc.gone_how(st['pid'])}; state cleared")
        return "already gone"
    return stop_server(st, state_file=server_record.STATE)


def cmd_serve(args) -> int:
    if args.dry_run or args.foreground:
        return _print_or_exec(args)
    state = serve_profile(args.profile, args.model, image=args.image, vllm_cmd=args.vllm, port=args.port,
                          run_id=args.run_id, timeout=args.timeout, shm_size=args.shm_size, wait=not args.no_wait,
                          round_name=args.round, tier=args.tier)
    print(state["run_id"])
    return 0


def _say_unread(contest: dict, rnd: rounds.Round) -> None:
    note = unread.unread_note(contest, rnd.name, "server", "add --round final --tier T, make serve ROUND=final "
                              "TIER=T, to serve a final-round tier")
    if note:
        ui.warn(note)


def _print_or_exec(args) -> int:
    """--dry-run prints the checked command; --foreground (inside the image) becomes the server."""
    contest = contest_mod.load_contest()
    rnd = rounds.load_round(contest, args.round or rounds.DEFAULT_ROUND)
    prof = profiles.load_profile(args.profile, contest, rnd=rnd)
    model = _env_or(args.model, "MODEL")
    image = _env_or(args.image, "IMAGE")
    if not model and not args.dry_run:
        raise ForgeError("no model directory given", hint="pass --model DIR (make serve MODEL=DIR)")
    # a dry run looks at no model folder: without one, the start script's own variable stands for it
    model_path = Path(model).resolve() if not args.dry_run else Path(model or "$MODEL_DIR")
    rendered = render(prof, model_path, contest, rnd, args.tier, cards=not args.dry_run)
    port = args.port or LOCKED_PORT
    run_id = runs.check_run_id(args.run_id) if args.run_id is not None else runs.new_run_id(prof["name"])
    container = f"forge-serve-{run_id}".lower()
    cmd = launch_command(rendered, image=image, vllm_cmd=args.vllm, port=port,
                         container=container, shm_size=args.shm_size)
    env_text = " ".join(f"{k}={shlex.quote(v)}" for k, v in rendered["env"].items())
    _say_unread(contest, rnd)
    say_headroom(rendered, rnd, probe=not args.dry_run)
    if args.dry_run:
        print(f"# profile {prof['name']} ({' -> '.join(prof['chain'])}): checked against configs/contest.yaml")
        if "round" in rendered:
            v = rounds.visible_cards({**os.environ, **rendered["env"]})
            print(f"# the {rendered['round']} round, tier {rendered['tier']}: {rendered['sources']}; cards visible "
                  f"here: {v.count if v.count is not None else 'cannot tell'} ({v.source})")
        if not model:
            print("# no --model: '$MODEL_DIR' stands for the model folder (the start script's variable)")
        print(f"{env_text} {proc.fmt(rendered['argv'])}")
        if cmd[1:] != rendered["argv"][1:] or image:
            print(f"# launched as:\n{proc.fmt(cmd)}")
        return 0
    # inside the image: the checked command replaces this process (PID 1 stays the server)
    if image:
        raise ForgeError("--foreground runs the server in this process; it cannot start an image")
    ui.info(f"{env_text} {proc.fmt(cmd)}")
    proc.replace_process(cmd, env=rendered["env"])
    return 0                            # not reached


def start_server(prof: dict, model_path: Path, *, contest: dict, port: int, run_id: str,
                 image: str | None = None, vllm_cmd: str | None = None, shm_size: str = "64g",
                 wait: bool = True, timeout: float = 1800, state_file: Path | None = None,
                 harness_args: list[str] | None = None, extra_env: dict[str, str] | None = None,
                 run_dir: Path | None = None, process_env: dict[str, str] | None = None,
                 rnd: rounds.Round | None = None, tier: str | None = None,
                 differences: list[dict] | None = None) -> dict:
    """Start one server for a loaded profile (the command checked against the contest rules), record
    it in `state_file` (default: the one `forge stop` reads) and, with `wait`, return once /health
    answers. `harness_args`/`extra_env` are the GPU harness's additions (random weights and the like):
    they are appended after the check, recorded, and mark the run as not comparable to a scored one.
    `run_dir` is the run folder (default reports/runs/<run_id>); `process_env` is added to the
    server's environment without being recorded (e.g. where a private site folder is). `rnd`/`tier`:
    a server of that round (default: the preliminary) for that tier; the record adds its settings (and
    `differences`, the harness's changes with their reasons)."""
    state_file = state_file or server_record.STATE
    rendered = render(prof, model_path, contest, rnd, tier, env={**(process_env or {}), **(extra_env or {})})
    container = f"forge-serve-{run_id}".lower()
    cmd = launch_command(rendered, image=image, vllm_cmd=vllm_cmd, port=port,
                         container=container, shm_size=shm_size) + list(harness_args or [])
    env = {**rendered["env"], **(extra_env or {})}
    scored = port == LOCKED_PORT and not harness_args
    if not image and not (model_path / "config.json").is_file():
        raise ForgeError(f"{model_path}: no config.json here; not a model directory",
                         hint="pass --model DIR with the model's config.json, tokenizer and weights")
    host = contest["server"]["host"]
    if port_open(host, port):
        raise ForgeError(f"port {port} on {host} is already in use by another process",
                         hint="stop it first (find it with `ss -ltnp | grep :%d`)" % port)
    rdir = Path(run_dir) if run_dir else runs.run_dir(run_id, create=False)
    # resuming a run keeps its profile: its serve.json and results must describe one server
    runs.refuse_other_profile(rdir, prof["name"], "this server would run", hint=(
        f"start a new run: omit --run-id (or give a new one); --profile {{prior}} --run-id {run_id} resumes it"))
    created = not rdir.exists()
    rdir.mkdir(parents=True, exist_ok=True)
    log = rdir / "server.log"
    # the run's record of its server (serve.json) is written once the server is up: a start that
    # fails leaves only the server log it names (not tracked), and a new run folder holds nothing else
    record = {
        "profile": prof["name"], "profile_chain": prof["chain"], "description": prof["description"],
        "model": str(model_path), "image": image, "command": rendered["argv"], "launch": cmd,
        "env": rendered["env"], "port": port, "scored_port": scored, "started": runs.now_iso(),
        **({"harness_args": list(harness_args), "harness_env": dict(extra_env or {})} if harness_args else {}),
        **({"differences": differences} if differences else {}),
        **{k: rendered[k] for k in ("round", "tier", "settings", "sources", "tier_env") if k in rendered},
    }
    if harness_args:
        ui.info(f"harness server (not a scored run): {proc.fmt(harness_args)}")
    elif not scored:
        ui.warn(f"port {port} instead of the locked {LOCKED_PORT}: results of this server are not comparable to a scored run")
    env_text = " ".join(f"{k}={shlex.quote(v)}" for k, v in rendered["env"].items())
    ui.info(f"starting profile {prof['name']} (run {run_id}); log: {paths.rel(log)}")
    ui.info(f"{env_text} {proc.fmt(cmd)}")
    try:
        p = proc.start(cmd, log=log, env={**(process_env or {}), **env}, what="server",
                       hint="install docker" if image else "install our vLLM wheel")
    except BaseException:
        if created:                     # nothing started: no log to read, no run
            log.unlink(missing_ok=True)
            runs.prune_empty(rdir)
        raise
    # what `forge stop` checks before it signals: this boot, the pid's start time, a command line ending
    # with the server's own arguments (a launcher that execs keeps them), the process group it leads
    state = {"pid": p.pid, "pgid": os.getpgid(p.pid), "start_time": proc.process_start_time(p.pid),
             "cmdline": proc.command_line(p.pid, wait_s=5.0) or cmd, "server_args": cmd[len(cmd) - len(rendered["argv"]) + 1
                                                                    - len(harness_args or []):],
             "boot_id": proc.boot_id(), "run_id": run_id, "run_dir": str(rdir), "log": str(log), "profile": prof["name"],
             "model": str(model_path), "image": image, "container": container if image else None,
             "host": host, "port": port, "health": contest["server"]["health_path"],
             "served_model_name": contest["server"]["served_model_name"], "started": runs.now_iso(),
             "state_file": str(state_file)}
    if state["start_time"] is not None:   # else it has exited already: nothing to record for `forge stop`
        state_file.parent.mkdir(parents=True, exist_ok=True)
        runs.write_json(state_file, state)
    state["popen"] = p
    if wait:
        try:
            wait_healthy(p, state, timeout=timeout)
        except BaseException:
            stop_server(state, quiet=True, state_file=state_file)
            raise
        state["ready"] = True
        dp = (rendered.get("settings") or {}).get("data_parallel_size", 1)
        record["kv_cache"] = state["kv_cache"] = serverlog.kv_cache_report(log.read_text(errors="replace"), dp)
        if record["kv_cache"]["flag"]:
            ui.warn(f"run {run_id}: {record['kv_cache']['flag']} (recorded in serve.json)")
    runs.write_json(rdir / "serve.json", record)
    return state


def wait_healthy(p, state: dict, timeout: float) -> None:
    url = f"http://{state['host']}:{state['port']}{state['health']}"
    t0 = time.monotonic()
    last = t0
    while True:
        rc = p.poll()
        if rc is not None:
            text = Path(state["log"]).read_text(errors="replace") if Path(state["log"]).exists() else ""
            causes = diagnose(text)
            msg = f"the server exited (code {rc}) before it became ready\n--- last lines of {paths.rel(state['log'])} ---\n" \
                  + proc.tail(Path(state["log"]), 30)
            hint = "; ".join(f"likely cause: {c} -> {f}" for c, f in causes) or "read the log above"
            raise ForgeError(msg, hint=hint)
        if health_ok(url):
            return
        now = time.monotonic()
        if now - t0 > timeout:
            raise ForgeError(f"the server did not answer {url} within {timeout:.0f}s\n--- last lines of "
                             f"{paths.rel(state['log'])} ---\n" + proc.tail(Path(state["log"]), 30),
                             hint="a first start compiles kernels; raise --timeout, or read the log")
        if now - last >= 15:
            ui.info(f"waiting for {url}: {now - t0:.0f}s / {timeout:.0f}s")
            last = now
        time.sleep(0.5)


def stop_server(st: dict, quiet: bool = False, grace_s: float = 30.0, state_file: Path | None = None) -> str:
    """Stop the server `st` describes (its whole process group; SIGKILL after `grace_s`) and drop its
    record, `state_file`: the path the caller derived itself (a record's own "state_file" key is data,
    never trusted as a path to delete)."""
    if st.get("container") and shutil.which("docker"):
        proc.run(["docker", "stop", "-t", str(int(grace_s)), st["container"]], check=False, capture=True,
                 timeout=grace_s + 30)
    how = "already gone"
    if st.get("start_time") is not None and server_record.still_ours(st, state_file or server_record.STATE):
        how = proc.stop_group(st["pgid"], grace_s=grace_s)
    if st.get("popen") is not None:
        st["popen"].poll()              # reap our own child
    if state_file is not None and state_file.is_file():
        state_file.unlink()
    if not quiet:
        ui.info(f"server pid {st['pid']} (run {st['run_id']}): {how}")
    return how


def cmd_stop(args) -> int:
    stop_running_server()
    return 0


def register(sub) -> None:
    p = sub.add_parser("serve", help="start the contest server command for a profile and wait for /health",
                       description="Render the organizers' start script (configs/contest.yaml server.start_script: "
                                   "`vllm serve $MODEL_DIR --served-model-name Qwen3.5-27B --port 8001 ...`) with "
                                   "the profile's environment (and reviewed options, if any), check it against "
                                   "configs/contest.yaml, start it (in IMAGE, or from the installed wheel) and wait "
                                   "for /health. Prints the run id; the log goes to reports/runs/<run-id>/server.log. "
                                   "With --round final --tier T: the finals' start script (configs/contest.yaml "
                                   "rounds.final) with the tier's topology and capacity values from the environment "
                                   "or the profile, its cards checked before anything runs.")
    p.add_argument("--profile", default="contest", help="configs/serve/<profile>.yaml (default: contest)")
    p.add_argument("--round", choices=rounds.ROUNDS, default=os.environ.get("ROUND") or None,
                   help="the contest's round (default: $ROUND, else preliminary): final renders the finals' start "
                        "script with the tier's topology and capacity values (README 'The final round')")
    p.add_argument("--tier", default=os.environ.get("TIER") or None,
                   help="the tier this server is for (default: $TIER); the final round needs one")
    p.add_argument("--model", help="model directory (default: $MODEL)")
    p.add_argument("--image", help="run in this container image (default: $IMAGE); else the installed wheel")
    p.add_argument("--dry-run", action="store_true", help="print the command, checked against the contest's rules, "
                                                            "and exit (the model folder is not looked at)")
    p.add_argument("--timeout", type=options.number_in(0, 86400, "seconds", "1800", True), default=1800,
                   help="seconds to wait for /health (default 1800)")
    p.add_argument("--run-id", help="run folder name under reports/runs/ (default: <time>-<profile>)")
    p.add_argument("--shm-size", default="64g", type=options.shm_size,
                   help="container shared memory (default 64g; a whole number with an optional unit b, k, m or g)")
    p.add_argument("--vllm", help="how to start vLLM natively, e.g. 'python3 -m vllm.entrypoints.cli.main' "
                                  "(default: `vllm` on PATH, else this Python's module)")
    p.add_argument("--port", type=options.port, default=None,
                   help="testing only: listen elsewhere than the locked 8001 (the run is marked unscored)")
    p.add_argument("--foreground", action="store_true",
                   help="exec the checked server command in this process (the image's entrypoint)")
    p.add_argument("--no-wait", action="store_true", help="return once started, without waiting for /health")
    p.set_defaults(func=cmd_serve)
    s = sub.add_parser("stop", help="stop the server `forge serve` started (and only that one)")
    s.set_defaults(func=cmd_stop)
