"""`forge e2e-gpu`'s install (`--install-only`, and every run's first step on a GPU machine) replaces its
--site folder whole. A --site that names a folder of something else (files, and no marker of an earlier
install) is refused before anything is removed: exit 2, one error line naming the option and the folder,
every file left as it was. A folder an earlier install wrote, an install cut off mid-way (its partial
marker) and an empty folder are installed into. Before, any --site was deleted first."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from helpers import forge, probe_bundle
from test_bad_inputs import refused, writes_nothing

from forge.cli import build_parser
from forge.errors import ForgeError
from forge.lab import install
from forge.run.gpu_harness import SITE_MARKER


def _install(tmp_path: Path, site: Path):
    return forge(tmp_path, "e2e-gpu", "--install-only", "--bundle", str(probe_bundle(tmp_path)), "--site", str(site))


def test_a_folder_of_something_else_is_refused_and_left_as_it_is(tmp_path):
    home = tmp_path / "home"
    (home / "notes").mkdir(parents=True)
    (home / "notes" / "plan.txt").write_text("mine")
    (home / "x.py").write_text("print(1)")
    probe_bundle(tmp_path)                     # made before: the check covers only the folder
    with writes_nothing(home):
        r = _install(tmp_path, home)
    refused(r, "--site", str(home), SITE_MARKER)
    # a file named as the site: refused too
    (tmp_path / "afile").write_text("x")
    with writes_nothing(tmp_path / "afile"):
        refused(_install(tmp_path, tmp_path / "afile"), "--site", "not a folder")


def test_an_empty_new_earlier_or_interrupted_site_is_installed_into(tmp_path):
    for name, prepare in (("new", None), ("empty", "mkdir"), ("interrupted", "partial"), ("earlier", "marker")):
        site = tmp_path / name
        if prepare:
            site.mkdir()
        if prepare == "partial":          # an install cut off after pip wrote some files
            (site / install.PARTIAL).write_text("{}")
            (site / "half_written").write_text("x")
        if prepare == "marker":           # an install of another bundle
            (site / SITE_MARKER).write_text("{}")
            (site / "oldpkg").mkdir()
        r = _install(tmp_path, site)
        assert r.returncode == 0, (name, r.stderr[-2000:])
        assert (site / "forgeprobe" / "__init__.py").is_file() and (site / SITE_MARKER).is_file(), name
        assert not (site / install.PARTIAL).exists() and not (site / "half_written").exists(), name
        assert not (site / "oldpkg").exists(), name


def test_an_install_pip_refuses_leaves_the_site_as_it_found_it(tmp_path):
    """A wheel pip cannot install: a new --site (and the folders made for it) is gone again, an empty one stays
    empty (before, the site was left holding the install's partial marker)."""
    bundle = _bad_bundle(tmp_path)
    man = json.loads((bundle / "manifest.json").read_text())
    (tmp_path / "empty").mkdir()
    for site in (tmp_path / "new" / "deeper" / "site", tmp_path / "empty"):
        with pytest.raises(ForgeError, match="pip could not install its wheels"):
            install.install_bundle(bundle, site, man)
    assert not (tmp_path / "new").exists()
    assert (tmp_path / "empty").is_dir() and not any((tmp_path / "empty").iterdir())


def test_install_only_refuses_the_run_options_it_would_ignore(tmp_path):
    """--install-only installs and exits: any other option given a value other than its default (read from
    the verb's own parser, so an option added later is covered too) is refused by name before anything is
    installed; before, they were silently ignored."""
    site = tmp_path / "site"
    bundle = probe_bundle(tmp_path)
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "e2e-gpu", "--install-only", "--bundle", str(bundle), "--site", str(site),
                  "--profiles", "fast-int8", "--kv-cache-memory-bytes", "1073741824", "--no-fault",
                  "--round", "final", "--out", str(tmp_path / "out"))
    line = refused(r, "--install-only", "run without --install-only")
    # every one named, in the order --help lists them, and no other (--bundle and --site are what it uses)
    assert line.split(" so ", 1)[1].split(" would be ignored")[0] == \
        "--profiles, --out, --round, --kv-cache-memory-bytes, --no-fault", line
    assert not site.exists()
    # an option given its default value is not a run's option: installed
    r = forge(tmp_path, "e2e-gpu", "--install-only", "--bundle", str(bundle), "--site", str(site),
              "--deadline-s", "560", "--round", "preliminary")
    assert r.returncode == 0 and (site / SITE_MARKER).is_file(), r.stderr[-2000:]


def test_install_only_help_says_the_other_options_are_refused(tmp_path):
    r = forge(tmp_path, "e2e-gpu", "--help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    assert "any other option set to other than its default is refused" in text


def test_every_option_of_e2e_gpu_is_named_as_its_destination_says():
    """The --install-only refusal names an option from its argparse destination (--opt-name from opt_name): true
    of every option the verb has, a later one included."""
    sub = next(a for a in build_parser()._actions if a.dest == "verb").choices["e2e-gpu"]
    for a in sub._actions:
        if a.dest != "help":
            assert f"--{a.dest.replace('_', '-')}" in a.option_strings, a.option_strings

def _bad_bundle(tmp_path: Path) -> Path:
    bundle = tmp_path / "bad-bundle"
    (bundle / "wheels").mkdir(parents=True)
    whl = bundle / "wheels" / "vllm-0.18.1-py3-none-any.whl"
    whl.write_bytes(b"not a zip archive")
    man = {"version": "bad", "vllm_wheel": whl.name, "python": "3.12",
           "files": {f"wheels/{whl.name}": {"sha256": hashlib.sha256(whl.read_bytes()).hexdigest()}}}
    (bundle / "manifest.json").write_text(json.dumps(man))
    return bundle


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


def test_a_bundle_pip_refuses_leaves_an_earlier_install_as_it_was(tmp_path):
    """A good install, then a bundle pip cannot install into the same --site: refused, and the earlier install
    is there exactly as it was, with no working folder left beside it (before, the site was emptied first)."""
    site = tmp_path / "site"
    assert _install(tmp_path, site).returncode == 0
    before = _tree(site)
    assert (site / "forgeprobe" / "__init__.py").is_file()
    man = json.loads((_bad_bundle(tmp_path) / "manifest.json").read_text())
    with pytest.raises(ForgeError, match="pip could not install its wheels"):
        install.install_bundle(tmp_path / "bad-bundle", site, man)
    assert _tree(site) == before
    assert [p.name for p in tmp_path.iterdir() if "site" in p.name] == ["site"]


def test_an_install_cut_off_between_its_two_renames_is_repaired_by_a_rerun(tmp_path):
    """The new install is complete beside the site and the earlier one renamed aside, and the site itself is
    gone (cut off between the renames): a rerun of the same bundle moves the new one in (no pip) and removes
    the earlier one; a rerun of another bundle installs it. A working folder beside the site that holds
    something else is refused by name and left as it was."""
    site = tmp_path / "site"
    assert _install(tmp_path, site).returncode == 0
    new, old = install.sibling(site, "new"), install.sibling(site, "old")
    assert new.parent == old.parent == site.parent and new.name.startswith(".site") and old.name != new.name
    # simulate: the install being replaced aside, the new one complete beside it, no site
    site.rename(new)
    old.mkdir()
    (old / SITE_MARKER).write_text("{}")
    (old / "oldpkg").mkdir()
    r = _install(tmp_path, site)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "already installed" in r.stderr + r.stdout                     # repaired, not reinstalled
    assert (site / "forgeprobe" / "__init__.py").is_file() and not new.exists() and not old.exists()
    # the same state, then a rerun with another bundle: installed, nothing left beside the site
    site.rename(new)
    old.mkdir()
    (old / SITE_MARKER).write_text("{}")
    (new / SITE_MARKER).write_text("another bundle's")
    r = _install(tmp_path, site)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "installing 1 wheels" in r.stderr + r.stdout
    assert (site / "forgeprobe" / "__init__.py").is_file() and not new.exists() and not old.exists()
    # cut off after both renames: the earlier install aside is removed by the next run
    old.mkdir()
    (old / SITE_MARKER).write_text("{}")
    assert _install(tmp_path, site).returncode == 0 and not old.exists()
    # a folder of something else where the install would work: refused, untouched
    new.mkdir()
    (new / "mine.txt").write_text("mine")
    (site / SITE_MARKER).write_text("another bundle's")
    with writes_nothing(tmp_path):
        refused(_install(tmp_path, site), "--site", new.name, "holds other files")


def test_stop_servers_refuses_the_run_options_it_would_ignore(tmp_path):
    """--stop-servers stops what an earlier invocation left up and exits: given with a run's options (as if it
    meant "stop the servers at the end"), it is refused naming each before anything is stopped or written;
    before, it stopped nothing, said so and exited 0, and the run never happened."""
    out = tmp_path / "out"
    out.mkdir()
    with writes_nothing(tmp_path):
        r = forge(tmp_path, "e2e-gpu", "--stop-servers", "--out", str(out), "--round", "final",
                  "--profiles", "contest,upstream", "--tier-order", "4-8K", "--num-prompts", "12")
    line = refused(r, "--stop-servers stops the servers", "run without --stop-servers")
    assert line.split(" so ", 1)[1].split(" would be ignored")[0] == \
        "--profiles, --num-prompts, --tier-order, --round", line
    r = forge(tmp_path, "e2e-gpu", "--stop-servers", "--out", str(out))
    assert r.returncode == 0 and "nothing to stop" in r.stderr + r.stdout, r.stderr
