"""Reading CMake as far as the offline check needs: command invocations with their arguments and
line numbers (comments, quoted, bracket and unquoted arguments), and a three-valued evaluation of
if() conditions against the variables that are known (True, False, or None: not evaluated)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

TRUE_CONST = {"1", "ON", "YES", "TRUE", "Y"}
FALSE_CONST = {"0", "OFF", "NO", "FALSE", "N", "IGNORE", "NOTFOUND", ""}


@dataclass
class Cmd:
    name: str
    args: list[tuple[str, bool]]        # (text, quoted)
    line: int

    def text(self) -> str:
        return f"{self.name}(" + " ".join(f'"{a}"' if q else a for a, q in self.args) + ")"


# --- reading ------------------------------------------------------------------------------

_BRACKET_OPEN = re.compile(r"\[(=*)\[")


def parse_cmake(text: str) -> list[Cmd]:
    """The command invocations of a CMake file, with their arguments and line numbers."""
    cmds, i, n, line = [], 0, len(text), 1
    while i < n:
        c = text[i]
        if c == "\n":
            line += 1
            i += 1
        elif c.isspace():
            i += 1
        elif c == "#":
            m = _BRACKET_OPEN.match(text, i + 1)
            end = text.find(f"]{m.group(1)}]", m.end()) if m else text.find("\n", i)
            end = n if end < 0 else end + (len(m.group(1)) + 2 if m else 0)
            line += text.count("\n", i, end)
            i = end
        elif c.isalpha() or c == "_":
            m = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\s*\(").match(text, i)
            if not m:
                i += 1
                continue
            start_line = line
            line += text.count("\n", i, m.end())
            args, i, line = _args(text, m.end(), line)
            cmds.append(Cmd(m.group(0).split("(")[0].strip().lower(), args, start_line))
        else:
            i += 1
    return cmds


def _args(text: str, i: int, line: int) -> tuple[list[tuple[str, bool]], int, int]:
    args: list[tuple[str, bool]] = []
    depth, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "\n":
            line += 1
            i += 1
        elif c.isspace():
            i += 1
        elif c == "#":
            m = _BRACKET_OPEN.match(text, i + 1)
            end = text.find(f"]{m.group(1)}]", m.end()) if m else text.find("\n", i)
            end = n if end < 0 else end + (len(m.group(1)) + 2 if m else 0)
            line += text.count("\n", i, end)
            i = end
        elif c == "(":
            depth += 1
            args.append(("(", False))
            i += 1
        elif c == ")":
            if depth == 0:
                return args, i + 1, line
            depth -= 1
            args.append((")", False))
            i += 1
        elif c == '"':
            j, buf = i + 1, []
            while j < n and text[j] != '"':
                if text[j] == "\\" and j + 1 < n:
                    buf.append(text[j:j + 2] if text[j + 1] not in '"\\' else text[j + 1])
                    j += 2
                    continue
                buf.append(text[j])
                j += 1
            line += text.count("\n", i, j)
            args.append(("".join(buf), True))
            i = j + 1
        elif c == "[" and (m := _BRACKET_OPEN.match(text, i)):
            end = text.find(f"]{m.group(1)}]", m.end())
            end = n if end < 0 else end
            args.append((text[m.end():end], True))
            line += text.count("\n", i, end)
            i = end + len(m.group(1)) + 2
        else:
            j = i
            while j < n and not text[j].isspace() and text[j] not in '()"#':
                j += 2 if text[j] == "\\" else 1
            args.append((text[i:j], False))
            i = j
    return args, i, line


# --- conditions ---------------------------------------------------------------------------------

_VAR = re.compile(r"\$(ENV)?\{([^${}]*)\}")


def expand(s: str, ctx: dict) -> str | None:
    """`s` with ${VAR} (and $ENV{VAR}) references replaced, or None when one is unknown."""
    unknown = False

    def rep(m):
        nonlocal unknown
        if not m.group(1) and m.group(2) in ctx:
            return ctx[m.group(2)]
        unknown = True
        return ""
    while _VAR.search(s):
        s = _VAR.sub(rep, s)
        if unknown:
            return None
    return s


UNARY = {"EXISTS", "IS_DIRECTORY", "DEFINED", "COMMAND", "TARGET", "POLICY", "IS_ABSOLUTE", "IS_SYMLINK", "TEST"}
BINARY = {"STREQUAL", "STRLESS", "STRGREATER", "STRLESS_EQUAL", "STRGREATER_EQUAL", "EQUAL", "LESS", "GREATER",
          "LESS_EQUAL", "GREATER_EQUAL", "MATCHES", "VERSION_EQUAL", "VERSION_LESS", "VERSION_GREATER",
          "VERSION_LESS_EQUAL", "VERSION_GREATER_EQUAL", "IN_LIST", "IS_NEWER_THAN", "PATH_EQUAL"}


class Cond:
    """A three-valued evaluation of an if() argument list: True, False or None (not evaluated)."""

    def __init__(self, args: list[tuple[str, bool]], ctx: dict, root: Path):
        self.toks, self.pos, self.ctx, self.root = args, 0, ctx, root
        self.names: list[str] = []      # the variables it could not evaluate (environment: "ENV{X}")

    def value(self) -> bool | None:
        if not self.toks:
            return False
        v = self._or()
        return v if self.pos == len(self.toks) else None

    def _peek(self) -> str | None:
        return self.toks[self.pos][0] if self.pos < len(self.toks) and not self.toks[self.pos][1] else None

    def _or(self):
        v = self._and()
        while self._peek() == "OR":
            self.pos += 1
            w = self._and()
            v = True if True in (v, w) else (None if None in (v, w) else False)
        return v

    def _and(self):
        v = self._not()
        while self._peek() == "AND":
            self.pos += 1
            w = self._not()
            v = False if False in (v, w) else (None if None in (v, w) else True)
        return v

    def _not(self):
        if self._peek() == "NOT":
            self.pos += 1
            v = self._not()
            return None if v is None else not v
        return self._primary()

    def _primary(self):
        if self._peek() == "(":
            self.pos += 1
            v = self._or()
            if self._peek() == ")":
                self.pos += 1
            return v
        if self.pos >= len(self.toks):
            return None
        tok = self.toks[self.pos]
        if not tok[1] and tok[0] in UNARY:
            self.pos += 1
            arg = self.toks[self.pos] if self.pos < len(self.toks) else ("", True)
            self.pos += 1
            return self._unary(tok[0], arg)
        self.pos += 1
        if self._peek() in BINARY:
            op = self._peek()
            self.pos += 1
            right = self.toks[self.pos] if self.pos < len(self.toks) else ("", True)
            self.pos += 1
            return self._binary(self._operand(tok), op, self._operand(right))
        return self._truth(tok)

    def _operand(self, tok) -> str | None:
        text, quoted = tok
        if not quoted and text in self.ctx:
            return self.ctx[text]
        if not quoted and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", text) and text.upper() not in TRUE_CONST | FALSE_CONST \
                and not text.isdigit():
            self.names.append(f"CMake variable {text}")
            return None                 # an unquoted name: a variable we do not know
        return expand(text, self.ctx)

    def _truth(self, tok):
        text, quoted = tok
        val = expand(text, self.ctx)
        if val is None:
            return None
        if quoted or "${" in text:
            name = val
            if name.upper() in TRUE_CONST or re.fullmatch(r"-?[1-9][0-9]*(\.[0-9]*)?", name):
                return True
            if name.upper() in FALSE_CONST or name.upper().endswith("-NOTFOUND"):
                return False
            if quoted:
                return False        # a quoted non-constant string is false (policy CMP0054)
        if val.upper() in TRUE_CONST:
            return True
        if val.upper() in FALSE_CONST:
            return False
        if val in self.ctx:
            v = self.ctx[val]
            return not (v.upper() in FALSE_CONST or v.upper().endswith("-NOTFOUND"))
        self.names.append(f"CMake variable {val}")
        return None                 # a variable we do not know

    def _unary(self, op: str, arg):
        text = arg[0]
        if op == "DEFINED":
            m = re.fullmatch(r"ENV\{(.+)\}", text)
            if m:
                self.names.append(f"environment variable {m.group(1)}")
                return None
            if text in self.ctx:
                return True
            self.names.append(f"CMake variable {text}")
            return None
        if op in ("EXISTS", "IS_DIRECTORY"):
            path = expand(text, self.ctx)
            if path is None:
                return None
            p = Path(path)
            try:
                p.resolve().relative_to(self.root.resolve())
            except ValueError:
                return None         # outside the tree: a property of the build machine
            return p.is_dir() if op == "IS_DIRECTORY" else p.exists()
        return None

    @staticmethod
    def _binary(a, op, b):
        if a is None or b is None:
            return None
        if op == "STREQUAL":
            return a == b
        if op == "MATCHES":
            try:
                return re.search(b, a) is not None
            except re.error:
                return None
        if op in ("EQUAL", "LESS", "GREATER", "LESS_EQUAL", "GREATER_EQUAL"):
            try:
                x, y = float(a), float(b)
            except ValueError:
                return False
            return {"EQUAL": x == y, "LESS": x < y, "GREATER": x > y, "LESS_EQUAL": x <= y,
                    "GREATER_EQUAL": x >= y}[op]
        return None
