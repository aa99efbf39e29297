"""YAML configs, validated on load. A mistake is an error naming the file, the key and what is allowed.

A schema is a dict {key: Field}. Field types: str, int, float, bool, list, dict, or a nested schema
(dict of Fields) for mappings, `Field(list, item=...)` for typed lists, and `Field(dict, value=...)`
for free-form mappings with typed values.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .errors import ForgeError
from .paths import CONFIGS, LOOP_HINT, ROOT, name_problem, rel

_MISSING = object()


@dataclass
class Field:
    type: Any                      # python type, or a nested schema dict
    required: bool = True
    default: Any = _MISSING
    choices: tuple | None = None
    item: Any = None               # element type/schema for lists
    value: Any = None              # value type/schema for free-form dicts
    check: Callable[[Any], str | None] | None = None   # returns an error text or None
    doc: str = ""


def hex_digest(n: int) -> Callable[[Any], str | None]:
    pat = re.compile(rf"^[0-9a-f]{{{n}}}$")
    return lambda v: None if pat.match(str(v)) else f"expected {n} lowercase hex characters, got {v!r}"


def plain_name(value: Any) -> str | None:
    """A Field check for a name from a config that becomes a path (a tier's name, a file in DATA_DIR):
    the tool's one rule for such names (paths.name_problem)."""
    return name_problem(value)


def load_yaml(path: Path) -> Any:
    """A YAML file's content ({} for an empty file). A file that is missing, a folder, not a regular file
    (a FIFO, a device: read_regular), not UTF-8 text, not YAML, or a mapping that gives one key twice (YAML
    would silently keep the last) is a ForgeError naming the file."""
    import yaml  # lazy: the bootstrap step runs before PyYAML is guaranteed

    path = Path(path)
    try:
        text = read_regular(path).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ForgeError(f"{rel(path)}: not UTF-8 text (byte {e.start}), so not YAML",
                         hint="save the file as UTF-8 text") from None
    try:
        return yaml.load(text, Loader=_unique_keys_loader(yaml)) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = str(getattr(e, "problem", None) or e)
        raise ForgeError(f"{rel(path)}: not valid YAML: {where}{problem}",
                         hint="give the key once (YAML would keep only the last)" if "given twice" in problem else
                         "correct the YAML at the line and column named") from None


def read_regular(path: Path) -> bytes:
    """The bytes of a regular file. Missing, a folder, a symlink loop, or not a regular file (a FIFO, a
    device such as /dev/zero, a socket) is a ForgeError naming it. Anything but a regular file is refused
    before it is opened, and the file is opened without blocking and checked again once open, so a FIFO
    (even one put in its place meanwhile) never waits for a writer."""
    fd = None
    try:
        mode = os.stat(path).st_mode
        if stat.S_ISREG(mode):
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except (FileNotFoundError, NotADirectoryError):
        raise ForgeError(f"{rel(path)}: file not found", hint="check the path (configs live in configs/)") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ForgeError(f"{rel(path)}: a symlink loop", hint=LOOP_HINT) from None
        raise
    if fd is not None:
        with os.fdopen(fd, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            if stat.S_ISREG(mode):
                return f.read()
    if stat.S_ISDIR(mode):
        raise ForgeError(f"{rel(path)}: is a folder, not a file", hint="give the YAML file itself")
    kind = ("a named pipe (FIFO)" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "a special file")
    raise ForgeError(f"{rel(path)}: not a regular file but {kind}; nothing was read from it",
                     hint="give a regular file: write what a pipe or <(...) would give into a file first")


def _unique_keys_loader(yaml):
    """yaml.SafeLoader that refuses a mapping giving the same key twice."""
    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            self.flatten_mapping(node)
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                if not isinstance(key, (str, int, float, bool)):
                    continue
                if key in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is given twice",
                                                            key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep=deep)
    return Loader


def written_values(path: Path) -> dict:
    """A YAML mapping's values as the file writes them, for a file load_yaml has read: {key: text} for
    an unquoted scalar, {key: None} for anything else (a quoted string, a list, a mapping). YAML 1.1
    reads `1_000`, `0x10` and `1:30` as numbers; a reader that holds a file's numbers to the command
    line's rule (options.parse_number) reads this text instead of the loaded value."""
    import yaml  # lazy: as load_yaml, for the bootstrap step

    node = yaml.compose(Path(path).read_bytes().decode("utf-8"), Loader=yaml.SafeLoader)
    if not isinstance(node, yaml.MappingNode):
        return {}
    return {k.value: v.value if isinstance(v, yaml.ScalarNode) and v.style is None else None
            for k, v in node.value if isinstance(k, yaml.ScalarNode)}


def written_text(path: Path, keys: tuple) -> str | None:
    """The text of the unquoted scalar a YAML file writes at `keys` (the mapping keys down to it, outermost first),
    as written_values gives a top-level one's; None for a quoted string, any other node, or a key not there."""
    import yaml  # lazy: as load_yaml, for the bootstrap step

    node = yaml.compose(Path(path).read_bytes().decode("utf-8"), Loader=yaml.SafeLoader)
    for key in keys:
        node = next((v for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == key), None) \
            if isinstance(node, yaml.MappingNode) else None
    return node.value if isinstance(node, yaml.ScalarNode) and node.style is None else None


def _tname(t: Any) -> str:
    if isinstance(t, dict):
        return "mapping"
    return {str: "string", int: "integer", float: "number", bool: "true/false",
            list: "list", dict: "mapping"}.get(t, getattr(t, "__name__", str(t)))


def check_type(value: Any, t: Any, file: str, key: str) -> Any:
    if isinstance(t, dict):
        if not isinstance(value, dict):
            raise ForgeError(f"{file}: key '{key}': expected a mapping, got {type(value).__name__}")
        return validate(value, t, file, key)
    if t is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if t is int and isinstance(value, bool) or (t is not bool and isinstance(value, bool) and t is not object):
        raise ForgeError(f"{file}: key '{key}': expected {_tname(t)}, got {value!r}")
    if t is not object and not isinstance(value, t):
        raise ForgeError(f"{file}: key '{key}': expected {_tname(t)}, got {type(value).__name__} {value!r}")
    return value


def validate(data: dict, schema: dict[str, Field], file: str, prefix: str = "") -> dict:
    """Return a copy of `data` with defaults filled, or raise ForgeError naming file and key."""
    if not isinstance(data, dict):
        raise ForgeError(f"{file}: expected a mapping at {prefix or 'top level'}")
    out: dict = {}
    for k in data:
        if k not in schema:
            where = f"{prefix}.{k}" if prefix else str(k)
            raise ForgeError(f"{file}: unknown key '{where}'",
                             hint=f"allowed keys{' under ' + prefix if prefix else ''}: {', '.join(sorted(schema))}")
    for k, f in schema.items():
        key = f"{prefix}.{k}" if prefix else k
        if k not in data or data[k] is None and f.required is False:
            if f.required and f.default is _MISSING:
                raise ForgeError(f"{file}: missing key '{key}'" + (f" ({f.doc})" if f.doc else ""))
            out[k] = None if f.default is _MISSING else f.default
            continue
        v = check_type(data[k], f.type, file, key)
        if f.type is list and f.item is not None:
            v = [check_type(x, f.item, file, f"{key}[{i}]") for i, x in enumerate(v)]
        if f.type is dict and f.value is not None:
            v = {kk: check_type(vv, f.value, file, f"{key}.{kk}") for kk, vv in v.items()}
        if f.choices is not None:
            vals = v if isinstance(v, list) else [v]
            for x in vals:
                if x not in f.choices:
                    raise ForgeError(f"{file}: key '{key}': {x!r} is not allowed",
                                     hint=f"allowed values: {', '.join(map(str, f.choices))}")
        if f.check is not None:
            err = f.check(v)
            if err:
                raise ForgeError(f"{file}: key '{key}': {err}")
        out[k] = v
    return out


def load(name_or_path: str | Path, schema: dict[str, Field]) -> dict:
    """Load configs/<name> (or a path) and validate it against `schema`."""
    p = Path(name_or_path)
    if not p.is_absolute() and not p.exists():
        p = CONFIGS / p
    return validate(load_yaml(p), schema, rel(p))


# --- the pipeline's own configs -------------------------------------------------------------

UPSTREAM_SCHEMA = {
    "name": Field(str, choices=("vllm",)),
    "version": Field(str),
    "sdist": Field({
        "project": Field(str, doc="project name on the package index"),
        "filename": Field(str),
        "sha256": Field(str, check=hex_digest(64)),
        "tree_sha256": Field(str, check=hex_digest(64),
                             doc="content hash of the extracted source tree (forge fetch --print-tree-hash)"),
    }),
    "git": Field({
        "url": Field(str, required=False, default=None,
                     doc="the vendor mirror; or set VLLM_GIT_URL"),
        "tag": Field(str),
        "commit": Field(str, check=lambda v: None if re.match(r"^[0-9a-f]{7,40}$", v)
                        else f"expected a hex commit id (7-40 chars), got {v!r}"),
    }),
    "vendor": Field({
        "repository": Field(str), "branch": Field(str),
        "commit": Field(str, check=lambda v: None if re.match(r"^[0-9a-f]{7,40}$", v)
                        else f"expected a hex commit id (7-40 chars), got {v!r}"),
        "public_copy": Field(str),
        "scope": Field({"files": Field(list, item=str), "folders": Field(list, item=str)},
                       doc="the files vLLM's build and runtime read; the pin covers exactly these"),
        "scope_sha256": Field(str, check=hex_digest(64), doc="tree hash of the scope (forge fetch --print-tree-hash "
                                                              "DIR --vendor-scope)"),
        "changed": Field(dict, value={"size": Field(int), "sha256": Field(str, check=hex_digest(64))},
                         doc="scoped files whose content differs from the sdist's"),
        "absent": Field(list, item=str, doc="scoped sdist files the vendor tree lacks (generated by the sdist)"),
        "standin_patch": Field(str, doc="the CI stand-in's change to the sdist (not part of the series)"),
    }, required=False, default=None, doc="the vendor tree's pin (BASE=vendor, BASE=standin)"),
}

BUILD_SCHEMA = {
    "rocm_arch": Field(list, item=str, doc="PYTORCH_ROCM_ARCH for the full build"),
    "aot_targets": Field(list, item=str, doc="Triton ahead-of-time targets checked by the rehearsal"),
    "max_jobs": Field(int, required=False, default=None),
    "base_image": Field(str, doc="vendor DTK vLLM image reference"),
    "base_image_digest": Field(str, required=False, default=None,
                               check=lambda v: None if re.match(r"^sha256:[0-9a-f]{64}$", v) else
                               f"expected sha256:<64 hex>, got {v!r}", doc="filled by make pin-base"),
    "image_name": Field(str),
    "wheel_local_tag": Field(str, doc="local version label: 0.18.1+<tag>.<series hash>"),
    "rehearsal": Field({
        "torch": Field(str, doc="pip requirement for the rehearsal venv's CPU torch"),
        "extra_packages": Field(list, item=str, required=False, default=[]),
        "standin_torch": Field(str, doc="pip requirement for the stand-in base's CPU torch (Python 3.11)"),
        "serve_help_must_contain": Field(list, item=str),
    }),
}


def upstream() -> dict:
    return load("upstream.yaml", UPSTREAM_SCHEMA)


def build() -> dict:
    return load("build.yaml", BUILD_SCHEMA)


MEASUREMENTS_SCHEMA = {"documents": Field(list, item=dict, doc="[{path, what}], in the order the plan lists them")}
MEASUREMENT_DOC_SCHEMA = {"path": Field(str, doc="repository-relative path of the document"),
                          "what": Field(str, doc="one line: what it measures")}


def measurements(path: Path | str = "measurements.yaml") -> list[dict]:
    """The measurement documents the optimization plan links (configs/measurements.yaml), each checked
    to exist."""
    p = Path(path)
    if not p.is_absolute() and not p.exists():
        p = CONFIGS / p
    cfg = load(p, MEASUREMENTS_SCHEMA)
    docs = [validate(d, MEASUREMENT_DOC_SCHEMA, rel(p), f"documents[{i}]") for i, d in enumerate(cfg["documents"])]
    for i, d in enumerate(docs):
        if not (ROOT / d["path"]).is_file():
            raise ForgeError(f"{rel(p)}: key 'documents[{i}].path': {d['path']} does not exist",
                             hint="fix the path, or remove the entry if the document is gone")
    return docs
