"""configs/contest.yaml: the contest's rules, validated on load."""

from __future__ import annotations

from .config import Field, load

RULE = {"text": Field(str)}
SCHEMA = {
    "rules": Field(dict, value=RULE),
    "forbidden_paths": Field(list, item={"glob": Field(str), "rule": Field(str)}),
}


def load_contest(path: str = "contest.yaml") -> dict:
    data = load(path, SCHEMA)
    from .errors import ForgeError
    for i, fp in enumerate(data["forbidden_paths"]):
        if fp["rule"] not in data["rules"]:
            raise ForgeError(f"configs/{path}: key 'forbidden_paths[{i}].rule': unknown rule {fp['rule']!r}",
                             hint=f"rules defined: {', '.join(sorted(data['rules']))}")
    return data
