"""`forge gpu-bundle`: everything the end-to-end run on a GPU machine needs, in build/gpu-bundle/.

The GPU machine has a different torch than vLLM's compiled extension is built for, no toolchain to
build it and no network. The bundle holds: the patched pure-Python vLLM wheel with the harness overlay
(harness/gpu: a plain-torch stand-in for `vllm._C` and three import guards; never part of the
product series), the Python wheels the machine's image lacks, and a model directory (the real
Qwen3.5-27B config.json plus a word-level tokenizer of the model's vocabulary size). manifest.json
lists every file with its sha256; `forge e2e-gpu` verifies it before installing.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

from .. import config, proc, records, ui
from ..builder import tree, wheel
from ..errors import ForgeError
from ..hashing import sha256_file
from ..paths import BUILD, CACHE, ROOT, TREE, rel, write_atomic
from ..recipe import provenance
from ..recipe.patchfile import read_series
from ..run.gpu_harness import HARNESS, harness_config

BUNDLE = BUILD / "gpu-bundle"
EOS_TEXT = "<|endoftext|>"
UNK_TEXT = "<unk>"
# The organizers' start script turns on the Qwen3 reasoning parser and the qwen3_coder tool parser, which
# need these tokens in the vocabulary; with thinking off (their --default-chat-template-kwargs) the
# template ends the prompt with an empty think block, as Qwen3.5's own template does, so the server
# streams everything as content. They take the vocabulary's last ids.
SPECIAL_TEXTS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['content'] }}{% if not loop.last %} {% endif %}"
                 "{% endfor %}{% if add_generation_prompt and enable_thinking is defined and not enable_thinking %}"
                 " <think> </think>{% endif %}")


def harness_patches() -> list[Path]:
    """The harness patches in series order (the same series format and checks as patches/)."""
    return [HARNESS / "patches" / n for n in read_series(HARNESS / "patches")]


def overlay_files() -> list[tuple[Path, str]]:
    root = HARNESS / "overlay"
    return [(p, p.relative_to(root).as_posix()) for p in sorted(root.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts]


def harness_hash() -> str:
    """One hash over the harness (config, patches, overlay): part of the bundle wheel's version."""
    files = [HARNESS / "harness.yaml", HARNESS / "patches" / "series", *harness_patches(),
             *(p for p, _ in overlay_files())]
    text = "".join(f"{p.relative_to(HARNESS).as_posix()}\0{sha256_file(p)}\n" for p in files)
    return hashlib.sha256(text.encode()).hexdigest()


def apply_harness(src: Path) -> list[str]:
    """Apply the harness patches and overlay to an exported tree; names what it applied."""
    done = []
    # `git apply` inside some repository's work tree (build/ is inside this one) silently skips
    # paths outside the current directory; stop its repository discovery at `src`
    env = {"GIT_CEILING_DIRECTORIES": str(Path(src).resolve().parent)}
    for p in harness_patches():
        r = proc.run(["git", "apply", "--check", str(p)], cwd=src, capture=True, check=False, env=env)
        if r.returncode != 0:
            raise ForgeError(f"harness patch {rel(p)} does not apply to the patched tree:\n{r.stderr.strip()}",
                             hint="the product series changed the lines it touches: update the harness patch "
                                  "against build/vllm (harness/gpu/README.md says how)")
        proc.run(["git", "apply", str(p)], cwd=src, capture=True, check=False, env=env)
        # proof that it landed: the reverse must apply now
        r = proc.run(["git", "apply", "--reverse", "--check", str(p)], cwd=src, capture=True, check=False, env=env)
        if r.returncode != 0:
            raise ForgeError(f"harness patch {rel(p)} did not take effect in {src}:\n{r.stderr.strip()}",
                             hint="check git's repository discovery around the build folder")
        done.append(p.name)
    for p, dst in overlay_files():
        target = src / dst
        if target.exists():
            raise ForgeError(f"harness overlay {rel(p)} would replace {dst}, which the tree has",
                             hint="the overlay only adds files; change the tree through a harness patch")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(p, target)
        done.append(dst)
    return done


def bundle_version(state: dict, hh: str) -> str:
    up, b = config.upstream(), config.build()
    # no ".cpu": vLLM would pick its CPU platform from the version string on the GPU machine
    return f"{up['version']}+{b['wheel_local_tag']}.{provenance.series_hash(state)[:10]}.gpuharness.{hh[:8]}"


def build_bundle_wheel(out_dir: Path) -> tuple[Path, dict]:
    state = tree.build_tree(TREE)
    hh = harness_hash()
    version = bundle_version(state, hh)
    # always rebuilt (about 10 s): the harness hash covers harness/gpu, not the code that applies it
    work = BUILD / "gpu-bundle-work"
    src = work / "src"
    ui.info(f"clean copy of {rel(TREE)} HEAD -> {rel(src)}")
    wheel.clean_copy(TREE, src)
    applied = apply_harness(src)
    rec = provenance.record(state, version=version, device="empty")
    rec["gpu_harness"] = {"hash": hh, "applied": applied,
                          "note": "GPU end-to-end harness build: not the product wheel"}
    whl = wheel.build_from_src(src, version, "empty", rec, work)
    names = set(__import__("zipfile").ZipFile(whl).namelist())
    if "vllm/_C.py" not in names:
        raise ForgeError(f"{whl.name} lacks the harness stand-in vllm/_C.py", hint="check harness/gpu/overlay")
    for old in out_dir.glob("vllm-*.whl"):
        old.unlink()
    final = out_dir / whl.name
    shutil.move(whl, final)
    shutil.rmtree(work, ignore_errors=True)
    return final, {"version": version, "harness_hash": hh, "series_hash": provenance.series_hash(state)}


def download_wheels(h: dict, out_dir: Path) -> list[Path]:
    """The extra wheels for the GPU machine's Python, through pip's own configuration (cached)."""
    cache = CACHE / f"gpu-wheels-py{h['python']}"
    cache.mkdir(parents=True, exist_ok=True)
    want = list(h["wheels"])

    def have(spec: str) -> Path | None:
        name, ver = spec.split("==")
        norm = name.lower().replace("-", "_")
        for w in cache.glob("*.whl"):
            parts = w.name.split("-")
            if parts[0].lower().replace("-", "_") == norm and parts[1] == ver:
                return w
        return None

    missing = [s for s in want if have(s) is None]
    if missing:
        plat = [x for p in h["platforms"] for x in ("--platform", p)]
        log = cache / "download.log"
        with ui.step(f"downloading {len(missing)} wheels for Python {h['python']}"):
            proc.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                      "--python-version", h["python"], "--implementation", "cp", *plat, "--platform", "any",
                      "-d", cache, *missing], log=log, what="pip download (GPU wheels)",
                     hint=f"see {rel(log)}; the pins are in harness/gpu/harness.yaml")
    found = []
    for s in want:
        w = have(s)
        if w is None:
            raise ForgeError(f"pip did not produce a wheel for {s}", hint="check the pin in harness/gpu/harness.yaml")
        shutil.copyfile(w, out_dir / w.name)
        found.append(out_dir / w.name)
    return found


def tokenizer_files(vocab_size: int, eos_id: int) -> dict[str, str]:
    """A word-level tokenizer with `vocab_size` entries: id 0 is <unk>, `eos_id` is <|endoftext|>, the
    last four ids the reasoning and tool-call tokens (SPECIAL_TEXTS), every other id i the word "w<i>". Words split on whitespace, so a text of n words is n tokens
    (what the synthetic tier prompts need)."""
    first_special = vocab_size - len(SPECIAL_TEXTS)
    if not 0 < eos_id < first_special:
        raise ForgeError(f"eos_token_id {eos_id} is outside the vocabulary (size {vocab_size}) or among its last "
                         f"{len(SPECIAL_TEXTS)} ids (the reasoning and tool-call tokens)")
    specials = {first_special + i: text for i, text in enumerate(SPECIAL_TEXTS)}
    vocab = {UNK_TEXT: 0}
    for i in range(1, vocab_size):
        vocab[EOS_TEXT if i == eos_id else specials.get(i, f"w{i}")] = i

    def added(i: int, text: str) -> dict:
        return {"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
                "normalized": False, "special": True}
    tok = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [added(0, UNK_TEXT), added(eos_id, EOS_TEXT), *(added(i, s) for i, s in specials.items())],
        "normalizer": None, "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None,
        "decoder": None, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": UNK_TEXT},
    }
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TEXT, "unk_token": UNK_TEXT,
           "pad_token": EOS_TEXT, "model_max_length": 262144, "clean_up_tokenization_spaces": False,
           "chat_template": CHAT_TEMPLATE}
    return {"tokenizer.json": json.dumps(tok, separators=(",", ":")),
            "tokenizer_config.json": json.dumps(cfg, indent=1),
            "chat_template.jinja": CHAT_TEMPLATE}


def write_model_dir(h: dict, out_dir: Path) -> list[Path]:
    m = h["model"]
    src = ROOT / m["config"]
    cfg = records.read_json(src)
    text = cfg.get("text_config", cfg)
    if text.get("vocab_size") != m["vocab_size"] or text.get("eos_token_id") != m["eos_token_id"]:
        raise ForgeError(f"{m['config']}: vocab_size/eos_token_id ({text.get('vocab_size')}, "
                         f"{text.get('eos_token_id')}) differ from harness/gpu/harness.yaml "
                         f"({m['vocab_size']}, {m['eos_token_id']})", hint="make them agree")
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, out_dir / "config.json")
    files = [out_dir / "config.json"]
    for name, body in tokenizer_files(m["vocab_size"], m["eos_token_id"]).items():
        (out_dir / name).write_text(body)
        files.append(out_dir / name)
    return files


def build_bundle(out: Path = BUNDLE) -> dict:
    h = harness_config()
    out.mkdir(parents=True, exist_ok=True)
    wdir = out / "wheels"
    wdir.mkdir(exist_ok=True)
    with ui.step("bundle: patched vLLM wheel + harness overlay"):
        vwhl, info = build_bundle_wheel(wdir)
    extra = download_wheels(h, wdir)
    keep = {vwhl.name, *(w.name for w in extra)}
    for stray in wdir.glob("*.whl"):
        if stray.name not in keep:
            stray.unlink()
    with ui.step("bundle: model directory (config.json + tokenizer)"):
        write_model_dir(h, out / "model")
    files = sorted(p for p in out.rglob("*") if p.is_file() and p.name != "manifest.json")
    total = sum(p.stat().st_size for p in files)
    manifest = {
        "what": "dcu-forge GPU end-to-end bundle (harness build; not the product wheel)",
        "vllm_wheel": vwhl.name, **info, "python": h["python"],
        "forge": provenance.forge_commit(),
        "files": {p.relative_to(out).as_posix(): {"sha256": sha256_file(p), "bytes": p.stat().st_size}
                  for p in files},
        "total_bytes": total,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    mib = total / 2**20
    if mib > h["max_bundle_mib"]:
        raise ForgeError(f"the bundle is {mib:.1f} MiB, over harness/gpu/harness.yaml max_bundle_mib "
                         f"({h['max_bundle_mib']})", hint="drop wheels the serve path does not import")
    ui.info(f"bundle: {rel(out)} ({mib:.1f} MiB, {len(files)} files); vllm {info['version']}")
    # beside the bundle (not in it; build/source-manifest.json for the default --out): what lets a copy of
    # this checkout without a current git folder name its commit (FORGE_SOURCE_MANIFEST on the GPU machine)
    beside = out.parent / "source-manifest.json"
    try:
        src = provenance.source_manifest()
    except ForgeError:
        ui.warn(f"no git here: {rel(beside)} not written (the GPU machine's records name no commit)")
    else:
        write_atomic(beside, json.dumps(src) + "\n")
    return manifest


def bundle_manifest(bundle: Path) -> Path:
    """The bundle's manifest.json; refused, naming the folder, where there is none."""
    mpath = bundle / "manifest.json"
    if not mpath.is_file():
        raise ForgeError(f"{bundle}: no manifest.json; not a GPU bundle", hint="build it with `make gpu-bundle`")
    return mpath


def verify_bundle(bundle: Path) -> dict:
    man = records.read_json(bundle_manifest(bundle))
    bad = []
    for name, e in man["files"].items():
        p = bundle / name
        if not p.is_file():
            bad.append(f"{name} (missing)")
        elif sha256_file(p) != e["sha256"]:
            bad.append(f"{name} (sha256 differs)")
    if bad:
        raise ForgeError(f"{bundle}: the bundle does not match its manifest: {', '.join(bad[:5])}",
                         hint="rebuild it with `make gpu-bundle` and send it again")
    return man


def cmd_gpu_bundle(args) -> int:
    build_bundle(Path(args.out) if args.out else BUNDLE)
    print(rel(Path(args.out) if args.out else BUNDLE))
    return 0


def register(sub) -> None:
    p = sub.add_parser("gpu-bundle", help="build the bundle for the end-to-end run on a GPU machine",
                       description=__doc__, formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    p.add_argument("--out", help="bundle folder (default: build/gpu-bundle)")
    p.set_defaults(func=cmd_gpu_bundle)
