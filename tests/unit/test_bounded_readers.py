"""The bounded readers: the tool's one JSON reader (forge.records.read_json) and the tuned table's loader
(kernels/forge_tuned, which runs inside vLLM at start-up) read only a regular file of bounded size: a FIFO
never holds them up, /dev/zero never fills the memory, a file past the bound is refused with the reason,
and the server runs on its built-in defaults ("no table can stop a server")."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from forge import records  # noqa: E402
from forge.errors import ForgeError  # noqa: E402

IDENT = {"device_name": "Stand-in Card", "arch": "gfx90a", "compute_units": 104, "toolkit": "hip 6.3",
         "torch": "2.10", "triton": "3.4", "driver": None}

# the loader in a child process of its own, held to 20 s and 1 GiB: a loader that waits or reads without
# end fails the case instead of holding up or exhausting the machine running the tests
LOADER = r'''
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
sys.path.insert(0, sys.argv[1])
import forge_tuned as T
try:
    T.read(sys.argv[2])
    read = "read"
except T.TableError as e:
    read = str(e)
table, line, bad = T.choose(json.loads(sys.argv[3]), sys.argv[2], folder=sys.argv[2] + ".none")
print(json.dumps({"read": read, "table": table, "line": line}))
'''


def _loader(path: Path) -> dict:
    r = subprocess.run([sys.executable, "-c", LOADER, str(ROOT / "kernels"), str(path), json.dumps(IDENT)],
                       capture_output=True, text=True, timeout=20)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


@pytest.mark.parametrize("kind", ["fifo", "device", "folder"])
def test_the_table_loader_refuses_what_is_not_a_regular_file_at_once(tmp_path, kind):
    p = tmp_path / "table.json"
    if kind == "fifo":
        os.mkfifo(p)
    elif kind == "device":
        os.symlink("/dev/zero", p)
    else:
        p.mkdir()
    got = _loader(p)
    assert "not a regular file" in got["read"], got
    assert got["table"] is None and "refused" in got["line"] and "built-in defaults" in got["line"], got


def test_the_table_loader_refuses_a_file_past_its_bound(tmp_path):
    sys.path.insert(0, str(ROOT / "kernels"))
    import forge_tuned as T
    p = tmp_path / "table.json"
    p.write_text("{" + " " * T.MAX_TABLE_BYTES + "}")
    got = _loader(p)
    assert "bytes" in got["read"] and got["table"] is None, got


def test_the_json_reader_refuses_a_file_past_its_bound(tmp_path, monkeypatch):
    p = tmp_path / "r.json"
    p.write_text(json.dumps({"x": "y" * 2000}))
    assert records.read_json(p) == {"x": "y" * 2000}
    monkeypatch.setattr(records, "MAX_JSON_BYTES", 1000)
    with pytest.raises(ForgeError, match=r"r\.json: 2,0\d\d bytes, more than the 1,000 a record may hold"):
        records.read_json(p)


@pytest.mark.parametrize("text,words", [
    ('{"a": {"b": 1, "b": 2}}', "key 'b' is given twice"),
    ("[" * 65 + "]" * 65, "nested deeper than 64"),
    ("[" * 100000 + "]" * 100000, "nested deeper than 64"),
    ('{"n": ' + "9" * 4301 + "}", "more than 4300 digits"),
])
def test_the_json_reader_refuses_what_no_record_holds(tmp_path, text, words):
    p = tmp_path / "r.json"
    p.write_text(text)
    with pytest.raises(ForgeError, match="r.json") as e:
        records.read_json(p)
    assert words in e.value.message and "\n" not in e.value.message


def test_the_json_reader_takes_a_record_at_its_bounds(tmp_path):
    p = tmp_path / "r.json"
    deep = "[" * 64 + "]" * 64
    p.write_text('{"n": ' + "9" * 4300 + ', "deep": ' + deep[2:-2] + "}")
    got = records.read_json(p)
    assert got["n"] == int("9" * 4300)
