"""Installing the verified bundle's wheels into a private site folder on the GPU machine, and the
versions its Python then sees."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from .. import proc, ui
from ..errors import ForgeError
from ..run.gpu_harness import SITE_MARKER
from . import gpu_bundle

PARTIAL = SITE_MARKER + ".partial"   # written first by an install, removed last: an interrupted one is ours too


def _ours(d: Path) -> bool:
    """`d` is a folder an install of ours wrote (its marker, or an interrupted one's) or an empty one."""
    return d.is_dir() and not d.is_symlink() and \
        ((d / SITE_MARKER).is_file() or (d / PARTIAL).is_file() or not any(d.iterdir()))


def refuse_foreign_site(site: Path) -> None:
    """An install replaces the site folder whole: refused (before anything is removed) where `site` is not a
    folder, or holds files of something else (neither an earlier install's marker nor an interrupted one's,
    and not empty), so a --site that names a user's folder is never deleted."""
    if site.is_symlink() or (site.exists() and not site.is_dir()):
        raise ForgeError(f"--site {site}: not a folder; the bundle is installed into a folder of its own",
                         hint="give a new folder (default /tmp/forge-e2e-site)")
    if site.is_dir() and not _ours(site):
        raise ForgeError(f"--site {site}: the folder holds other files and no {SITE_MARKER} of an earlier install; "
                         "installing replaces the folder whole, so it is left as it is",
                         hint="give a new or empty folder (default /tmp/forge-e2e-site)")


def sibling(site: Path, role: str) -> Path:
    """The folder beside `site` an install writes into ("new") or puts the install it replaces aside in
    ("old") until the swap: in the site's own parent, so both moves are renames, named after the site."""
    where = Path(os.path.abspath(site))
    if not where.name:
        raise ForgeError(f"--site {site}: names no folder of its own; the bundle is installed into a folder beside "
                         "which it writes the new install before swapping it in",
                         hint="give a new folder (default /tmp/forge-e2e-site)")
    return where.parent / f".{where.name}.forge-{role}"


def _settle(site: Path, new: Path, old: Path) -> None:
    """Finish a swap an earlier install was cut off in, then remove what it left beside the site: with no
    site, a complete new install is moved in (cut off between the two renames), else the install put aside
    is moved back. Folders of something else under those names are left for install_bundle to refuse."""
    if not site.exists() and not site.is_symlink():
        if _ours(new) and (new / SITE_MARKER).is_file() and not (new / PARTIAL).exists():
            new.rename(site)
        elif _ours(old):
            old.rename(site)
    for d in (new, old):
        if _ours(d):
            shutil.rmtree(d)


def install_bundle(bundle: Path, site: Path, man: dict | None = None) -> dict:
    """Install the bundle's wheels into `site` (skipped where they are installed already); `man`: the
    manifest verify_bundle returned, where the caller verified the bundle already. A site of another
    install (or of an interrupted one) is replaced; any other non-empty folder is refused. The wheels go
    into a folder beside the site first (sibling "new"), swapped in only once pip succeeded: the site is
    renamed aside ("old"), the new folder renamed in, the old one removed; a pip failure removes only the
    new folder (and the folders made for it), so an earlier install stays exactly as it was, and the next
    install finishes a swap an interruption cut off (_settle)."""
    man = man or gpu_bundle.verify_bundle(bundle)
    marker = site / SITE_MARKER
    wheels = sorted(str(bundle / n) for n in man["files"] if n.startswith("wheels/") and n.endswith(".whl"))
    key = json.dumps({n: e["sha256"] for n, e in man["files"].items() if n.startswith("wheels/")}, sort_keys=True)
    new, old = sibling(site, "new"), sibling(site, "old")
    _settle(site, new, old)
    if marker.is_file() and marker.read_text() == key:
        ui.info(f"bundle already installed in {site}")
        return man
    refuse_foreign_site(site)
    for d in (new, old):
        if d.exists() or d.is_symlink():
            raise ForgeError(f"--site {site}: {d.name} beside it holds other files; the install writes the new "
                             "install there (and puts the earlier one aside) before swapping it in, so it is left "
                             "as it is", hint=f"move {d} away, or give another --site")
    # the topmost folder this install creates (None: the site's parent exists), removed again if pip fails
    made = None if new.parent.exists() else next(p for p in (new.parent, *new.parent.parents) if p.parent.exists())
    new.mkdir(parents=True)
    try:
        (new / PARTIAL).write_text(key)
        with ui.step(f"installing {len(wheels)} wheels into {site}"):
            r = proc.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                          "--no-cache-dir", "--target", str(new), *wheels], capture=True, check=False, what="pip")
            if r.returncode != 0:          # one line: pip's errors (its last line where it marks none)
                lines = [x.strip() for x in r.stderr.splitlines() if x.strip()]
                why = "; ".join(x for x in lines if x.startswith("ERROR")) or (lines[-1] if lines else "no output")
                raise ForgeError(f"--bundle {bundle}: pip could not install its wheels into --site {site}: "
                                 f"{why[-1000:]}", hint="the bundle is built for Python " + man.get("python", "?")
                                 + "; rebuild it with `make gpu-bundle` for this machine's Python")
        (new / SITE_MARKER).write_text(key)
        (new / PARTIAL).unlink()
    except BaseException:
        # only what this install wrote goes: the new folder (and the folders made for it); the site is untouched
        shutil.rmtree(made or new, ignore_errors=True)
        raise
    # the swap: an interruption between the renames leaves the complete new folder and the earlier install
    # aside, which the next install's _settle moves in and removes
    if site.exists():
        site.rename(old)
    new.rename(site)
    shutil.rmtree(old, ignore_errors=True)
    return man


def install_only(bundle: str, site: Path) -> int:
    """`forge e2e-gpu --install-only`: verify the bundle and install its wheels into `site`, then exit;
    prints the site and the bundle's model directory (what `forge sweep --round final --harness` serves with)."""
    if not bundle:
        raise ForgeError("--install-only installs the bundle, and --bundle '' names none",
                         hint="give --bundle DIR (default build/gpu-bundle, from `make gpu-bundle`)")
    man = install_bundle(Path(bundle), site)
    ui.info(f"bundle {man['version']} installed in {site}")
    print(f"site {site}\nmodel {Path(bundle) / 'model'}")
    return 0


def versions(py: str, env: dict[str, str] | None = None) -> dict:
    """The Python, torch, triton, vLLM and transformers versions `py` imports, and its device."""
    code = ("import json,sys\nout={'python':sys.version.split()[0]}\n"
            "for m in ('torch','triton','vllm','transformers'):\n"
            "  try:\n    out[m]=__import__(m).__version__\n  except Exception as e:\n    out[m]=f'unavailable: {e}'\n"
            "try:\n  import torch\n  out['device']=torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu'\n"
            "except Exception:\n  pass\nprint(json.dumps(out))")
    try:
        r = proc.run([py, "-c", code], capture=True, check=False, timeout=300, env=env, what="version probe")
    except ForgeError as e:
        return {"error": e.message}
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"error": r.stderr[-500:]}
