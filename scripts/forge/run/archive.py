"""Recorded run folders (reports/e2e/<run>/, reports/runs/<run>/): the documents people read stay as files
(README.md, summary.md, decode.md: the summary carries the per-tier figures, the proxy scores and the DCU
prediction); everything else (summary.json, the per-profile scores and charts, predict/, per-tier `vllm
bench serve` results, rounds, server and client logs, manifests, server records) goes into one archive per
folder, `raw.tgz`, which holds the whole folder as it was, documents included.

`forge pack-run FOLDER` writes raw.tgz (deterministic: sorted members, fixed times and owners, gzip
header without a time, so the same files give the same bytes) and removes the raw files; `forge
unpack-run FOLDER [--to DIR]` restores them (the same as `tar -xzf FOLDER/raw.tgz -C FOLDER`)."""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import tarfile
import tempfile
import zlib
from pathlib import Path, PurePosixPath

from .. import options, paths, records, tarsafe, ui
from ..errors import ForgeError
from .runs import runs_root

ARCHIVE = "raw.tgz"
# what stays a file of a run folder: these names at its top level (the machine-readable files and the
# per-profile scores are in the archive; `forge unpack-run` brings them back for the tools that read them)
DOCUMENT_NAMES = frozenset({"README.md", "summary.md", "decode.md"})
MTIME = 0           # members' time in the archive (the files' own times are not part of the record)
# what a run record's archive may unpack to: the largest recorded holds 293 members and 2.6 MB; an archive
# past these limits (a decompression bomb, or not a run record) is refused before anything is written
MAX_MEMBERS = 20_000
MAX_UNPACKED_BYTES = 2 << 30
# what makes a folder a run folder, at its top level: an e2e results folder (summary.json, runs/ with a
# folder per profile, prefill-profile/ of --profile-prefill) or a run of reports/runs/ (serve.json,
# manifest.json). Any other folder (reports/predict/, a plan's logs) is refused: packing it would remove them.
RUN_MARKS = {"summary.json": Path.is_file, "runs": Path.is_dir, "serve.json": Path.is_file,
             "manifest.json": Path.is_file, "prefill-profile": Path.is_dir}
RUN_FOLDER_HINT = ("give a run folder: an e2e results folder (reports/e2e/<run>/, with summary.json and runs/) or "
                   "a run of reports/runs/<run>/ (with serve.json and manifest.json)")


def is_document(rel: Path) -> bool:
    """A file of a run folder (path relative to it) that stays out of the archive's removal."""
    return len(rel.parts) == 1 and rel.name in DOCUMENT_NAMES


def folder_files(folder: Path) -> list[Path]:
    """Every file of a run folder except its archive, relative to it, sorted."""
    return sorted(p.relative_to(folder) for p in folder.rglob("*")
                  if p.is_file() and p.relative_to(folder) != Path(ARCHIVE))


def raw_files(folder: Path) -> list[Path]:
    return [p for p in folder_files(folder) if not is_document(p)]


def write_archive(folder: Path, members: list[Path], dest: Path) -> None:
    """A .tar.gz of `members` (relative to `folder`), byte for byte the same for the same files."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tf:
        for rel in sorted(members, key=lambda p: p.as_posix()):
            data = (folder / rel).read_bytes()
            info = tarfile.TarInfo(rel.as_posix())
            info.size, info.mtime, info.mode = len(data), MTIME, 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tf.addfile(info, io.BytesIO(data))
    tmp = dest.with_name(f".{dest.name}.part")
    try:
        with open(tmp, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0,
                                                   compresslevel=9) as gz:
            gz.write(buf.getvalue())
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def pack_run(folder: Path, remove: bool = True) -> dict:
    """Pack a run folder: raw.tgz holds every file of it (documents included, so the archive alone is
    the whole record); the raw files are then removed unless `remove` is false. Returns
    {archive, members, removed}. A folder already packed (raw.tgz and no raw file left) is left as it is;
    an unpacked one (every member back in the folder) is packed again."""
    folder = Path(folder)
    dest = folder / ARCHIVE
    if check_packable(folder, remove=remove):
        return {"archive": dest, "members": None, "removed": []}
    raw = raw_files(folder)
    members = folder_files(folder)
    write_archive(folder, members, dest)
    removed = []
    if remove:
        for rel in raw:
            (folder / rel).unlink()
            removed.append(rel)
        for d in sorted((p for p in folder.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
            if not any(d.iterdir()):
                d.rmdir()
    return {"archive": dest, "members": members, "removed": removed}


def check_packable(folder: Path, remove: bool = True) -> bool:
    """Refuse (naming it) a folder `pack_run` cannot pack; True when it is packed already. Every folder of
    one `forge pack-run` is checked before the first is packed: a symlink loop, not a run folder
    (RUN_MARKS), a link out of it or to a folder, and (with `remove`) a raw file that git tracks are refused."""
    real, root = paths.resolved(folder), paths.ROOT
    if not folder.is_dir():
        raise ForgeError(f"{folder}: not a folder", hint="give a run folder, e.g. reports/e2e/<date>-<device>")
    if real == root or real in root.parents or (root in real.parents and not any(
            root / d in real.parents for d in ("reports", "build"))):
        where = ("a folder of this checkout outside reports/ and build/" if root in real.parents else
                 "this checkout or a folder holding it")
        raise ForgeError(f"{folder}: {where}; packing removes every file of the folder but its documents, so the "
                         "tool's own files would go", hint="give a run folder, e.g. reports/e2e/<date>-<device>")
    dest = folder / ARCHIVE
    raw = raw_files(folder)
    if dest.exists():
        if not raw:
            return True
        # raw files beside the archive: packed again only when the folder holds every member (an
        # unpacked folder, documents perhaps redone), so rewriting the archive loses nothing
        present = {p.as_posix() for p in folder_files(folder)}
        missing = [n for n in archive_members(dest) if n not in present]
        if missing:
            raise ForgeError(f"{paths.rel(dest)} exists, the folder holds raw files outside it "
                             f"({', '.join(p.as_posix() for p in raw[:3])}{', ...' if len(raw) > 3 else ''}) and "
                             f"lacks members of the archive ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})",
                             hint=f"unpack it (forge unpack-run {paths.rel(folder)}) so the folder holds the whole "
                                  "record, then pack again")
    if not raw:
        raise ForgeError(f"{paths.rel(folder)}: no raw files to pack (only documents)",
                         hint="a run folder holds runs/, logs/ or per-tier results next to its summary")
    if not any(is_mark(folder / name) for name, is_mark in RUN_MARKS.items()):
        marks = [n + ("/" if RUN_MARKS[n] is Path.is_dir else "") for n in RUN_MARKS]
        raise ForgeError(f"{paths.rel(folder)}: not a run folder (none of {', '.join(marks[:-1])} or {marks[-1]} at "
                         f"its top level); packing would remove its {len(raw)} raw files", hint=RUN_FOLDER_HINT)
    refuse_links_out(folder)
    if remove:
        refuse_tracked(folder, real, raw)
    return False


def refuse_tracked(folder: Path, real: Path, raw: list[Path]) -> None:
    """Refuse (naming the first few) raw files of `folder` (resolved: `real`) that git tracks: packing
    removes them, and the checkout would show them deleted."""
    tracked = set(paths.tracked_files(real))
    hit = [rel for rel in raw if (real / rel).relative_to(paths.ROOT).as_posix() in tracked] if tracked else []
    if hit:
        names = ", ".join(p.as_posix() for p in hit[:3]) + (", ..." if len(hit) > 3 else "")
        raise ForgeError(f"{paths.rel(folder)}: {len(hit)} of its raw files are tracked by git ({names}); packing "
                         "would remove them from the checkout; nothing was packed",
                         hint=f"pack a copy (cp -r {paths.rel(folder)} /tmp/{real.name}; forge pack-run "
                              f"/tmp/{real.name}), or untrack them first (git rm --cached) and commit raw.tgz in their place")


def refuse_links_out(folder: Path) -> None:
    """Refuse (naming it) a symbolic link under `folder` whose target lies outside it (packing would copy a
    file from elsewhere on the machine into the record, and the removal would leave the link) or that leads to
    a folder (the archive holds files, not links: the link was left out, and the removal failed at it once the
    raw files were gone)."""
    top = paths.resolved(folder)
    for p in sorted(folder.rglob("*")):
        if p.is_symlink():
            try:
                target = paths.resolved(p)
            except ForgeError:
                raise ForgeError(f"{paths.rel(p)}: a symlink loop (a link that leads back to itself); nothing was "
                                 "packed", hint="a record holds its own files: remove the link") from None
            if target != top and top not in target.parents:
                raise ForgeError(f"{paths.rel(p)}: a link to {os.readlink(p)}, outside the run folder; nothing was "
                                 "packed", hint="a record holds its own files: replace the link by a copy of what "
                                                "the run needs, or remove it")
            if p.is_dir():      # the archive holds files: the link would be lost, and the removal stopped at it
                raise ForgeError(f"{paths.rel(p)}: a link to a folder ({os.readlink(p)}); the archive holds files, "
                                 "not links, so the record would lose it; nothing was packed",
                                 hint="a record holds its own files: remove the link (its folder is packed as it is)")


@contextlib.contextmanager
def _opened(src: Path):
    """The archive open for reading; a damaged or unreadable one is a ForgeError naming it."""
    try:
        with tarfile.open(src, "r:gz") as tf:
            yield tf
    except (tarfile.TarError, EOFError, zlib.error) as e:
        raise ForgeError(f"{paths.rel(src)}: cannot be read ({e})", hint="the archive is damaged; take it from git")
    except OSError as e:
        if e.filename is not None:          # a file of the extraction (named by the caller), not the archive
            raise
        raise ForgeError(f"{paths.rel(src)}: cannot be read ({e})", hint="the archive is damaged; take it from git")


def archive_members(src: Path) -> list[str]:
    with _opened(src) as tf:
        return tf.getnames()


def unpack_run(folder: Path, to: Path | None = None, force: bool = False) -> list[str]:
    """Extract a run folder's raw.tgz into `to` (default: the folder itself); returns the member names.
    The whole archive is read and every member checked before the first file is written, and the
    extraction goes to a temporary folder that moves into place once complete: a damaged or unsafe
    archive leaves the disk as it was (no new `to` folder either). A file there whose content differs from
    the archive's (a local edit of summary.md) is replaced only with `force`."""
    folder = Path(folder)
    src = folder / ARCHIVE
    if not src.is_file():
        raise ForgeError(f"{paths.rel(src)} not found", hint="give a run folder that holds raw.tgz")
    dest = folder
    if to is not None and paths.resolved(Path(to), "--to") != folder.resolve():
        dest = paths.target_folder(str(to), "--to", outside_checkout=True,
                                   hint=f"leave --to out to unpack in place, or give a folder outside the checkout, "
                                        f"e.g. --to /tmp/{folder.name}")
        if paths.inside(dest, folder):
            # the raw files would land in a subfolder of the packed folder, which then no longer reads as packed
            raise ForgeError(f"--to {to}: inside {paths.rel(folder)}, the folder whose archive it unpacks; nothing "
                             "was extracted", hint=f"leave --to out to unpack in place, or give a folder beside it, "
                                                   f"e.g. --to {folder.parent / (folder.name + '-raw')}")
    with _opened(src) as tf:
        members = tf.getmembers()           # reads the whole archive: a damaged one fails here
        tarsafe.check_members(members, paths.rel(src))
        check_unpacked_size(members, paths.rel(src))
        own = [m.name for m in members if PurePosixPath(m.name) == PurePosixPath(ARCHIVE)]
        if own:                             # unpacked in place it would replace the archive being read
            raise ForgeError(f"{paths.rel(src)}: member {own[0]!r} would replace the archive itself; nothing was "
                             "extracted", hint="the archive is damaged or not one of ours; take it again")
        refuse_clashes(dest, members, paths.rel(src))
        there = {dest / m.name: m for m in members if m.isfile() and (dest / m.name).exists()}
        edited = records.changed_files({p: tf.extractfile(m).read() for p, m in there.items()})
        records.guard_recorded(paths.rel(dest), f"files that differ from {ARCHIVE}'s ({records.listed(edited)})"
                               if edited else None, doing="unpacking", force=force,
                               hint="keep your edit: copy it away first, or unpack with --to another folder")
        with paths.staged_folder(dest) as tmp:
            tarsafe.extract_tar(tf, tmp)
    return [m.name for m in members]


def check_unpacked_size(members: list, where: str) -> None:
    """Refuse an archive whose members or unpacked bytes are past what a run record holds (MAX_MEMBERS,
    MAX_UNPACKED_BYTES): unpacked, it could fill the disk."""
    total = sum(m.size for m in members if m.isfile())
    if len(members) > MAX_MEMBERS or total > MAX_UNPACKED_BYTES:
        raise ForgeError(f"{where}: {len(members):,} members, {total / 2**20:,.0f} MiB unpacked: more than a run "
                         f"record holds (at most {MAX_MEMBERS:,} members and {MAX_UNPACKED_BYTES >> 30} GiB); "
                         "nothing was extracted",
                         hint="the archive is damaged or not one of ours; take it again (or, if you trust it, list "
                              "it with tar -tzvf and extract it by hand)")


def refuse_clashes(dest: Path, members: list, where: str) -> None:
    """Refuse, before anything is extracted, an archive a member of which meets in `dest` what the move into
    place cannot replace: a file where its path needs a folder, a folder where it is a file or a link, or a
    link of `dest` on its path (the member would land wherever the link leads, outside the folder too)."""
    hint = "move it out of the way (or remove it), or unpack with --to another folder"
    for m in members:
        parts = PurePosixPath(m.name).parts
        for i in range(1, len(parts) + m.isdir()):
            p = dest.joinpath(*parts[:i])
            if p.is_symlink() or (p.exists() and not p.is_dir()):
                raise ForgeError(f"{paths.rel(p)}: {'a link' if p.is_symlink() else 'a file'}, where member "
                                 f"{m.name!r} of {where} needs a folder; nothing was extracted", hint=hint)
        p = dest.joinpath(*parts)
        if parts and not m.isdir() and p.is_dir() and not p.is_symlink():
            raise ForgeError(f"{paths.rel(p)}: a folder, where member {m.name!r} of {where} is a "
                             f"{'link' if m.issym() or m.islnk() else 'file'}; nothing was extracted", hint=hint)


def no_result(run: Path, tier: str, tiers: list[str]) -> ForgeError:
    """The refusal of a folder without tier `tier`'s result: one that holds no run at all (no manifest, no tier
    result, not an e2e results folder: e.g. the model's folder) is said as such, as compare says it; its fix
    named `forge bench-all-tiers --run-id <its name>`, which starts another run under the runs folder."""
    if not (any((run / f).is_file() for f in ("manifest.json", "serve.json", ARCHIVE)) or (run / "runs").is_dir()
            or any((run / f"{t}.json").is_file() for t in tiers)):
        return ForgeError(f"{run}: no tier results (<tier>.json) and no manifest.json: not a run folder",
                          hint=f"give a run folder that bench-all-tiers (or e2e-gpu) wrote, or a run id under "
                               f"{paths.rel(runs_root())}/ (ls {paths.rel(runs_root())}/)")
    return ForgeError(f"{run}: tier {tier} has no result ({tier}.json)", hint=no_result_hint(run, tier))


def no_result_hint(run: Path, tier: str) -> str:
    """What to give instead of a folder without tier `tier`'s result: a profile's run folder of an e2e results
    folder (runs/<profile>), how to read a packed record, or the commands that finish the run; a final-round
    run's (its manifest's round) start the tier's own server first and run the final round's client, which
    alone resumes it."""
    profiles = sorted(p.name for p in (run / "runs").iterdir() if p.is_dir()) if (run / "runs").is_dir() else []
    if profiles or (run / ARCHIVE).is_file():
        return (f"{run} is an e2e results folder: give one profile's run folder, {run}/runs/<profile>"
                + (f" ({', '.join(profiles)})" if profiles else f" (its files are in {ARCHIVE}: forge unpack-run {run} "
                                                              f"--to /tmp/{run.name}, then give /tmp/{run.name}/runs/<profile>)"))
    try:
        man = json.loads((run / "manifest.json").read_text())
    except (OSError, ValueError):       # no manifest, or a damaged one: the plain command
        man = None
    # --run-id names a run under the runs folder: a folder elsewhere is finished there, once moved
    first = ("" if paths.resolved(run).parent == paths.resolved(runs_root()) else
             f"move {run} into {paths.rel(runs_root())}/ (--run-id names a run there), then ")
    if isinstance(man, dict) and man.get("round") == "final":
        prof = man.get("profile") if isinstance(man.get("profile"), str) else "PROFILE"
        return (f"finish the run: {first}forge serve --round final --profile {prof} --tier {tier} --run-id {run.name}, "
                f"then forge bench-all-tiers --round final --run-id {run.name}")
    return f"finish the run: {first}forge bench-all-tiers --run-id {run.name}"


def is_packed(folder: Path) -> bool:
    """A packed record: raw.tgz and none of its raw files beside it."""
    folder = Path(folder)
    return (folder / ARCHIVE).is_file() and not raw_files(folder)


@contextlib.contextmanager
def readable(folder: Path):
    """The folder to read a run's raw files from: the folder itself, or for a packed record (is_packed)
    a temporary extraction of raw.tgz, removed on exit."""
    folder = Path(folder)
    if not is_packed(folder):
        yield folder
        return
    with tempfile.TemporaryDirectory(prefix=f"forge-{folder.name}-") as tmp:
        unpack_run(folder, Path(tmp))
        yield Path(tmp)


def read_hint(folder: Path, hint: str) -> str:
    """The hint of a tool that found no input in `folder`: for a packed record (is_packed) how to read
    it, else `hint`."""
    folder = Path(folder)
    if is_packed(folder):
        return (f"{paths.rel(folder)} is a packed record (its files are in {ARCHIVE}): "
                f"forge unpack-run {paths.rel(folder)} --to /tmp/{folder.name}, then give /tmp/{folder.name}")
    return hint


def refuse_nested(folders: list[str]) -> None:
    """Refuse a FOLDER of one `forge pack-run` that lies inside another given with it: the outer one's archive
    holds every file under it, so packed first it removed the inner one's files (the inner one then failed as no
    folder, the command half done), and packed after it, it held the inner one's raw.tgz, an archive in an archive."""
    for outer in folders:
        for inner in folders:
            if paths.inside(Path(inner), Path(outer)):
                raise ForgeError(f"{inner}: inside {outer}, given too; {outer}'s {ARCHIVE} holds every file under it, "
                                 f"{inner}'s included; nothing was packed",
                                 hint=f"give one of them: forge pack-run {outer} packs both")


def cmd_pack_run(args) -> int:
    for folder in args.folders:
        check_packable(Path(folder), remove=not args.keep_raw)
    refuse_nested(args.folders)
    for folder in args.folders:
        r = pack_run(Path(folder), remove=not args.keep_raw)
        if r["members"] is None:
            ui.info(f"{paths.rel(r['archive'])}: already packed")
        else:
            ui.info(f"{paths.rel(r['archive'])}: {len(r['members'])} files, "
                    f"{len(r['removed'])} raw files removed from the folder")
    return 0


def cmd_unpack_run(args) -> int:
    names = unpack_run(Path(args.folder), args.to, force=options.forced(args.force))
    ui.info(f"{len(names)} files from {paths.rel(Path(args.folder) / ARCHIVE)} into {args.to or args.folder}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("pack-run", help="pack a recorded run folder's raw files into its raw.tgz",
                       description="Pack each FOLDER's raw files into FOLDER/raw.tgz and remove them (--keep-raw "
                                   "leaves them); the documents stay beside it. A FOLDER must be a run folder (at "
                                   "its top level summary.json, runs/, serve.json, manifest.json or prefill-profile/), "
                                   "and a raw file git tracks is never removed: such a folder is refused, nothing "
                                   "packed.\n\n" + __doc__, formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    p.add_argument("folders", nargs="+", metavar="FOLDER", help="run folder(s), e.g. reports/e2e/<date>-<device>")
    p.add_argument("--keep-raw", action="store_true", help="write raw.tgz but leave the raw files in place")
    p.set_defaults(func=cmd_pack_run)
    p = sub.add_parser("unpack-run", help="restore a recorded run folder's raw files from its raw.tgz",
                       description="Restore FOLDER's raw files from FOLDER/raw.tgz (--to DIR: into DIR instead); "
                                   "every member is checked before anything is written.\n\n" + __doc__, formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    p.add_argument("folder", help="run folder holding raw.tgz")
    p.add_argument("--to", help="extract into this folder instead, outside FOLDER (the archive's paths are relative to the run folder)")
    p.add_argument("--force", action="store_true",
                   help="replace files that differ from the archive's (a local edit; also FORCE=1)")
    p.set_defaults(func=cmd_unpack_run)
