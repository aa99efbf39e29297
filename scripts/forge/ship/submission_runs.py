"""The recorded runs the submission's documents cite (configs/optimizations.yaml): two servers of one
run compared tier by tier, and each server's command held against the organizers' start script with
every difference named, so that figures measured under another command are never shown as the
submission's.

A run is a `forge e2e-gpu` folder (reports/e2e/<run>): `raw.tgz` holding `summary.json` and
`runs/<profile>/{serve.json,<tier>.json}`, or the same files unpacked.
"""

from __future__ import annotations

import re
import shlex
import tarfile
import zlib
from pathlib import Path

from .. import config, paths, records
from ..builder import tree
from ..contest import rules as contest_mod
from ..errors import ForgeError
from ..recipe import provenance
from ..run import results

HINT = "check configs/optimizations.yaml (the run and the profiles it served)"
# What a GPU machine that is not the card cannot avoid changing in the organizers' command: listed in
# the documents, and the run still counts as made under that command. {option: (English, Chinese)}
ACCEPTED = {
    "--port": ("the run's second server listens on its own port", "同一次运行的第二台服务使用自己的端口"),
    "--load-format": ("random weights, so the figures are relative effects, not answers",
                      "随机权重，数字只表示相对效果"),
    "--max-model-len": ("the rules' locked value (the start script sets none, so vLLM would size the cache for "
                        "the model's full context)", "规则锁定的取值"),
    "--gpu-memory-utilization": ("two servers share one GPU", "两台服务共用一块 GPU"),
    "--kv-cache-memory-bytes": ("two servers share one GPU, each with a fixed KV cache", "两台服务共用一块 GPU"),
    "--attention-backend": ("on a GPU that is not ROCm, the attention backend ROCm takes is forced",
                            "在非 ROCm 的 GPU 上强制使用 ROCm 所选的注意力后端"),
    "--gdn-prefill-backend": ("on a GPU that is not ROCm, the GDN prefill backend ROCm takes is forced",
                              "在非 ROCm 的 GPU 上强制使用 ROCm 所选的 GDN 预填充后端"),
    "--language-model-only": ("the text path only: the benchmark sends text", "只加载文本路径：测试只发送文本"),
}
COMPILATION = ("--compilation-config", "-O", "--enforce-eager")


def read_run(run: str) -> dict:
    """{"id", "path", "files": {"summary.json" | "runs/<profile>/<name>.json": data}} of a recorded run
    (packed or not); the rounds' files are not read."""
    folder = paths.ROOT / run
    want = re.compile(r"(?:^|/)(summary\.json|runs/[^/]+/[^/]+\.json)$")
    files: dict[str, object] = {}

    def keep(name: str, text: bytes, where: str) -> None:
        m = want.search(name)
        if not m or name.count("/") - m.group(1).count("/") > 1:
            return
        try:
            files.setdefault(m.group(1), records.parse_json(text.decode("utf-8"), where))
        except UnicodeDecodeError as e:
            raise ForgeError(f"{where}: not UTF-8 text (byte {e.start}), so not JSON",
                             hint="the run's record is damaged; take it from git") from None

    archive = folder / "raw.tgz"
    if archive.is_file():
        try:
            with tarfile.open(archive, "r:gz") as tf:
                for m in tf.getmembers():
                    if m.isfile() and m.name.endswith(".json") and want.search(m.name):
                        f = tf.extractfile(m)
                        keep(m.name, f.read() if f else b"null", f"{paths.rel(archive)}: {m.name}")
        except (tarfile.TarError, EOFError, zlib.error, OSError) as e:
            raise ForgeError(f"{paths.rel(archive)}: cannot be read ({e})", hint="take the archive from git") from None
    elif folder.is_dir():
        for p in sorted(folder.rglob("*.json")):
            keep(p.relative_to(folder).as_posix(), p.read_bytes(), paths.rel(p))
    if "summary.json" not in files:
        raise ForgeError(f"{run}: no recorded run there (raw.tgz with summary.json, or its files)", hint=HINT)
    return {"id": Path(run).name, "path": run, "files": files}


def _file(rec: dict, name: str) -> dict:
    data = rec["files"].get(name)
    if not isinstance(data, dict):
        raise ForgeError(f"{rec['path']}: no {name} in the run" if data is None else
                         f"{rec['path']}: {name} is not a JSON object", hint=HINT)
    return data


def server(rec: dict, profile: str) -> dict:
    """The recorded server of `profile`: its command line after `serve <model>` as [(option, value or
    True)], and its environment."""
    s = _file(rec, f"runs/{profile}/serve.json")
    launch = s.get("launch") or s.get("command") or []
    if "serve" not in launch or not isinstance(s.get("env"), dict):
        raise ForgeError(f"{rec['path']}: runs/{profile}/serve.json has no server command and environment",
                         hint="the run's record is damaged; take it from git")
    return {"options": options_of(launch[launch.index("serve") + 2:]), "env": s["env"]}


def options_of(argv: list[str]) -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if "=" in tok and tok.startswith("--"):
            name, value = tok.split("=", 1)
        elif i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            name, value = tok, argv[i + 1]
            i += 1
        else:
            name, value = tok, True
        out.append((contest_mod.option_base(name), value))
        i += 1
    return out


def shown(option: str, value: object) -> str:
    return option if value is True else f"{option} {shlex.quote(str(value))}"


def command_differences(contest: dict, srv: dict, profile: dict | None) -> list[dict]:
    """How a recorded server's command and environment differ from the organizers' start script run
    with `profile` (None: the command only): [{kind, option, value, organizers, accepted, en, zh}] (en: a
    sentence)."""
    ours = dict(srv["options"])
    theirs = {contest_mod.option_base(k): v for k, v in contest_mod.organizer_options(contest)}
    out = []
    for opt, want in theirs.items():
        if opt not in ours:
            out.append({"kind": "missing", "option": opt, "value": None, "organizers": want, "accepted": False,
                        "en": f"`{shown(opt, want)}` of the organizers' start script is missing.",
                        "zh": f"缺少组织方的 {opt}"})
        elif str(ours[opt]) != str(want):
            why = ACCEPTED.get(opt)
            out.append({"kind": "changed", "option": opt, "value": ours[opt], "organizers": want,
                        "accepted": why is not None,
                        "en": f"`{shown(opt, ours[opt])}` where the organizers' start script has `{shown(opt, want)}`"
                              + (f": {why[0]}." if why else "."),
                        "zh": f"{opt} 为 {ours[opt]}（组织方为 {want}）" + (f"：{why[1]}" if why else "")})
    for opt, value in srv["options"]:
        if opt in theirs:
            continue
        why = ACCEPTED.get(opt)
        if opt in COMPILATION:
            en, zh = "a hand-set compilation config instead of vLLM's default", "手动设置的编译配置，而非 vLLM 的默认配置"
        else:
            en, zh = why or ("not in the organizers' start script", "组织方的启动脚本中没有")
        out.append({"kind": "added", "option": opt, "value": value, "organizers": None,
                    "accepted": why is not None and opt not in COMPILATION,
                    "en": f"`{shown(opt, value)}` added: {en}.", "zh": f"另加了 {opt}：{zh}"})
    if profile is None:             # a component A/B: its servers differ from the submission by design
        return out
    want_env = {k: str(e["value"]) for k, e in profile["env"].items()}
    for k in sorted(set(want_env) | {k for k in srv["env"] if k.startswith("VLLM_FORGE_")}):
        got = srv["env"].get(k)
        if got != want_env.get(k):
            out.append({"kind": "env", "option": k, "value": got, "organizers": want_env.get(k), "accepted": False,
                        "en": f"`{k}` was {f'`{got}`' if got is not None else 'unset'} on the measured server, where "
                              f"the submission runs with {f'`{want_env[k]}`' if k in want_env else 'it unset'}.",
                        "zh": f"所测服务的 {k} 与本提交不同"})
    return out


def compare(rec: dict, with_: str, without: str, tiers: list[str], key: str = "configs/optimizations.yaml") -> dict:
    """Per tier, the output tok/s of both servers, the gain, the mean TTFT and TPOT ratios, the
    requests (completed, failed) and whether both produced the same output tokens; plus what differs
    between the two servers and what the run was made with. `key` names where the two profiles were
    asked for (a profile the run did not serve is an error naming it)."""
    served = sorted({n.split("/")[1] for n in rec["files"] if n.startswith("runs/")})
    for p in (with_, without):
        if p not in served:
            raise ForgeError(f"{key}: run {rec['id']} served no profile '{p}'",
                             hint=f"its profiles: {', '.join(served) or 'none'}")
    out: dict = {"tiers": {}}
    for t in tiers:
        a, b = (_file(rec, f"runs/{p}/{t}.json") for p in (with_, without))
        for p, res in ((with_, a), (without, b)):
            results.check_result(res, f"{rec['path']}: runs/{p}/{t}.json")
        (ta, qa), (tb, qb) = (results.mean_times_ms(r, f"{rec['path']}: {t}") for r in (a, b))
        if not b["output_throughput"]:
            raise ForgeError(f"{rec['path']}: runs/{without}/{t}.json: output_throughput 0", hint=HINT)
        lens = [sum(r["output_lens"]) if isinstance(r.get("output_lens"), list) else None for r in (a, b)]
        out["tiers"][t] = {"with_tok_s": a["output_throughput"], "without_tok_s": b["output_throughput"],
                           "gain": a["output_throughput"] / b["output_throughput"] - 1,
                           "ttft_ratio": ta / tb, "tpot_ratio": qa / qb, "requests": a["completed"],
                           "failed": a["failed"] + b["failed"],
                           "same_tokens": None if None in lens else lens[0] == lens[1]}
    sa, sb = server(rec, with_), server(rec, without)
    out["env_diff"] = {k: (sa["env"].get(k), sb["env"].get(k)) for k in sorted(set(sa["env"]) | set(sb["env"]))
                       if sa["env"].get(k) != sb["env"].get(k)}
    oa, ob = dict(sa["options"]), dict(sb["options"])
    out["option_diff"] = {k: (oa.get(k), ob.get(k)) for k in sorted(set(oa) | set(ob))
                          if k != "--port" and oa.get(k) != ob.get(k)}
    versions = _file(rec, "summary.json").get("versions") or {}
    out["device"] = versions.get("device") or "an unnamed GPU"
    out["versions"] = ", ".join(f"{k.capitalize() if k == 'python' else k} {v}" for k, v in versions.items()
                                if k not in ("device", "vllm") and v)
    m = re.search(r"\+forge\.([0-9a-f]{6,})", str(versions.get("vllm") or ""))
    out["series"] = m.group(1) if m else None
    out["harness"] = ".gpuharness." in str(versions.get("vllm") or "")   # the GPU machine's bundle build
    out["server"] = sa
    return out


def this_series() -> str:
    """The series hash a build of this checkout carries in its version (0.18.1+forge.<hash>): pinned
    upstream, kernel overlay and patches/series, as `make wheel` computes it."""
    state = {"upstream": config.upstream()["sdist"]["sha256"], "overlay": tree.overlay_hash(tree.overlay_entries()),
             "patches": [[n, d, None] for n, d in tree.series_inputs(paths.PATCHES)]}
    return provenance.series_hash(state)[:10]
