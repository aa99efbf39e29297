"""`make export`: the patched tree, ready for a scoring repository (where the contest runs
`python setup.py bdist_wheel` on the DCU): a tarball of the tree, one combined diff against pristine
upstream (overlay + patches), and a manifest with the hashes. With --into DIR, the patched tree's
files are also written into DIR (e.g. a checkout of your scoring repository) for you to commit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from .. import config, ui
from ..builder import tree, wheel
from ..errors import ForgeError
from ..hashing import sha256_file
from ..paths import DIST, TREE, rel, target_folder
from ..recipe import provenance


def export(out_dir: Path = DIST / "export", into: "Path | str | None" = None) -> dict:
    if into is not None:            # checked before the tree is built (minutes on a fresh machine)
        into = target_folder(str(into), "--into", outside_checkout=True)
        if not into.is_dir():
            raise ForgeError(f"--into {into}: not a directory", hint="give the checkout of your scoring repository")
    state = tree.build_tree()
    up = config.upstream()
    sh = provenance.series_hash(state)[:10]
    name = f"vllm-{up['version']}-forge.{sh}"
    out_dir.mkdir(parents=True, exist_ok=True)
    tarball = out_dir / f"{name}.tar.gz"
    diff = out_dir / f"{name}.diff"
    tree.git(TREE, "archive", "--format=tar.gz", f"--prefix={name}/", "-o", tarball, "HEAD")
    diff.write_text(tree.git_out(TREE, "diff", "--binary", "--full-index", tree.UPSTREAM_REF, "HEAD") + "\n")
    manifest = {
        "name": name, "upstream_sdist_sha256": up["sdist"]["sha256"], "series_hash": provenance.series_hash(state),
        "patches": [n for n, _, _ in state["patches"]], "tree_head": state["head"],
        "tarball": {"file": tarball.name, "sha256": sha256_file(tarball)},
        "diff": {"file": diff.name, "sha256": sha256_file(diff),
                 "apply": f"cd vllm-{up['version']} && git apply {diff.name}"},
        "build_on_dcu": "python setup.py bdist_wheel && pip install dist/vllm-*.whl --no-deps",
        "forge": provenance.forge_commit(),
    }
    (out_dir / f"{name}.manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    if into is not None:
        if any(into.glob("build/lib*")):
            ui.warn(f"{into}/build/ holds old build outputs: remove it before `setup.py bdist_wheel` "
                    "(stale build/lib has broken submissions)")
        tmp = out_dir / ".into"
        wheel.clean_copy(TREE, tmp)
        shutil.copytree(tmp, into, dirs_exist_ok=True)
        shutil.rmtree(tmp)
        ui.info(f"wrote the patched tree into {into}")
    ui.info(f"export: {rel(tarball)}, {rel(diff)}")
    return manifest


def cmd_export(args) -> int:
    m = export(Path(args.out), args.into)
    print(json.dumps(m, indent=1))
    return 0


HELP_STAGE = "builder"        # `forge --help` lists the verb with the build stage's: the built tree and wheel, packed


def register(sub) -> None:
    p = sub.add_parser("export", help="patched tree as a tarball + one combined diff, for a scoring repository",
                       description=__doc__)
    p.add_argument("--out", default=str(DIST / "export"), help="output folder (default dist/export)")
    p.add_argument("--into", help="also write the patched tree's files into this directory")
    p.set_defaults(func=cmd_export)
