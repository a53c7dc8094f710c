"""Reading Megatron-LM's sources without running them (Python `ast` only), for
tools/megatron_flag_list.py: modules and names resolved across its files, dataclass fields, their
types and defaults, and the flags Megatron-LM's `ArgumentGroupFactory` makes from them.
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass

# ----------------------------------------------------------------------------------------------
# module loading and name resolution
# ----------------------------------------------------------------------------------------------


class Repo:
    def __init__(self, root: str):
        self.root = root
        self._cache: dict[str, tuple[str, ast.Module] | None] = {}
        self.files_read: set[str] = set()

    def module_path(self, dotted: str) -> str | None:
        base = os.path.join(self.root, *dotted.split("."))
        for cand in (base + ".py", os.path.join(base, "__init__.py")):
            if os.path.isfile(cand):
                return cand
        return None

    def load(self, dotted: str) -> tuple[str, ast.Module] | None:
        if dotted not in self._cache:
            path = self.module_path(dotted)
            if path is None:
                self._cache[dotted] = None
            else:
                with open(path, encoding="utf-8") as fh:
                    self._cache[dotted] = (path, ast.parse(fh.read(), filename=path))
                self.files_read.add(path)
        return self._cache[dotted]

    @staticmethod
    def is_package(path: str) -> bool:
        return os.path.basename(path) == "__init__.py"

    def absolute(self, current: str, node: ast.ImportFrom) -> str:
        """Absolute dotted module of an ImportFrom made in module `current`."""
        if not node.level:
            return node.module or ""
        loaded = self.load(current)
        parts = current.split(".")
        if loaded is None or not self.is_package(loaded[0]):
            parts = parts[:-1]
        if node.level > 1:
            parts = parts[: len(parts) - (node.level - 1)]
        if node.module:
            parts += node.module.split(".")
        return ".".join(parts)


def import_map(repo: Repo, module: str, body: list[ast.stmt]) -> dict[str, tuple[str, str]]:
    """name -> (module, name) for `from X import a as b` found anywhere in `body` (incl. try/if)."""
    out: dict[str, tuple[str, str]] = {}
    for stmt in body:
        for node in ast.walk(stmt):
            if isinstance(node, ast.ImportFrom):
                mod = repo.absolute(module, node)
                for alias in node.names:
                    if alias.name != "*":
                        out[alias.asname or alias.name] = (mod, alias.name)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node is not stmt:
                pass
    return out


def top_level_imports(repo: Repo, module: str, tree: ast.Module) -> dict[str, tuple[str, str]]:
    """Module-level `from X import Y` (also inside top-level try/if), not inside defs."""
    out: dict[str, tuple[str, str]] = {}

    def visit(stmts):
        for s in stmts:
            if isinstance(s, ast.ImportFrom):
                mod = repo.absolute(module, s)
                for alias in s.names:
                    if alias.name != "*":
                        out[alias.asname or alias.name] = (mod, alias.name)
            elif isinstance(s, ast.Try):
                visit(s.body)
                for h in s.handlers:
                    visit(h.body)
                visit(s.orelse)
                visit(s.finalbody)
            elif isinstance(s, ast.If):
                visit(s.body)
                visit(s.orelse)

    visit(tree.body)
    return out


@dataclass
class ClassRef:
    module: str
    node: ast.ClassDef


def find_class(repo: Repo, module: str, name: str, _seen=None) -> ClassRef | None:
    """Find class `name` as seen from module `module` (follows re-exports)."""
    _seen = _seen or set()
    if (module, name) in _seen:
        return None
    _seen.add((module, name))
    loaded = repo.load(module)
    if loaded is None:
        return None
    _, tree = loaded
    for stmt in tree.body:
        if isinstance(stmt, ast.ClassDef) and stmt.name == name:
            return ClassRef(module, stmt)
    imports = top_level_imports(repo, module, tree)
    if name in imports:
        mod, orig = imports[name]
        found = find_class(repo, mod, orig, _seen)
        if found:
            return found
        # `from pkg import submodule` style is not a class; ignore
    for stmt in tree.body:  # star imports
        if isinstance(stmt, ast.ImportFrom) and any(a.name == "*" for a in stmt.names):
            found = find_class(repo, repo.absolute(module, stmt), name, _seen)
            if found:
                return found
    return None


def resolve_name_in(repo: Repo, module: str, expr: ast.expr, local_imports=None) -> ClassRef | None:
    """Resolve a Name / Attribute expression used in `module` to a class definition."""
    loaded = repo.load(module)
    if loaded is None:
        return None
    _, tree = loaded
    if isinstance(expr, ast.Name):
        if local_imports and expr.id in local_imports:
            mod, orig = local_imports[expr.id]
            return find_class(repo, mod, orig)
        return find_class(repo, module, expr.id)
    if isinstance(expr, ast.Attribute):
        # module.attr, e.g. enum.Enum or megatron.core.X -> try the attribute name via imports
        dotted = ast.unparse(expr.value)
        found = find_class(repo, dotted, expr.attr)
        if found:
            return found
    return None


# ----------------------------------------------------------------------------------------------
# dataclass fields -> argparse kwargs (mirrors megatron/training/argument_utils.py)
# ----------------------------------------------------------------------------------------------

MISSING = object()


class TypeInferenceError(Exception):
    pass


@dataclass
class FieldInfo:
    name: str
    annotation: ast.expr
    default: object = MISSING  # an ast.expr or MISSING
    default_factory: object = MISSING  # an ast.expr or MISSING
    init: bool = True
    metadata: ast.expr | None = None
    owner: ClassRef | None = None


def _is_dataclass(cls: ast.ClassDef) -> bool:
    return any("dataclass" in ast.unparse(d) for d in cls.decorator_list)


def _is_classvar(ann: ast.expr) -> bool:
    txt = ast.unparse(ann)
    return txt.startswith(
        ("ClassVar", "typing.ClassVar", "InitVar", "dataclasses.InitVar")
    ) or txt in (
        "KW_ONLY",
        "dataclasses.KW_ONLY",
    )


def dataclass_fields(repo: Repo, ref: ClassRef, _depth=0) -> dict[str, FieldInfo]:
    """Ordered fields like dataclasses.fields(): bases first, then own (overrides keep place)."""
    out: dict[str, FieldInfo] = {}
    for base in reversed(ref.node.bases):
        bref = resolve_name_in(repo, ref.module, base)
        if bref is not None and _depth < 20:
            for k, v in dataclass_fields(repo, bref, _depth + 1).items():
                out[k] = v
    if not _is_dataclass(ref.node):
        return out  # annotations of a plain class are not fields (bases may still be)
    for stmt in ref.node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        if _is_classvar(stmt.annotation):
            continue
        fi = FieldInfo(stmt.target.id, stmt.annotation, owner=ref)
        val = stmt.value
        if isinstance(val, ast.Call) and ast.unparse(val.func) in ("field", "dataclasses.field"):
            for kw in val.keywords:
                if kw.arg == "default":
                    fi.default = kw.value
                elif kw.arg == "default_factory":
                    fi.default_factory = kw.value
                elif kw.arg == "init":
                    fi.init = not (isinstance(kw.value, ast.Constant) and kw.value.value is False)
                elif kw.arg == "metadata":
                    fi.metadata = kw.value
        elif val is not None:
            fi.default = val
        out[fi.name] = fi
    return out


def _literal(node):
    try:
        return ast.literal_eval(node)
    except Exception:
        return MISSING


def _union_members(repo, module, node) -> list | None:
    """Flattened members of a Union / Optional / X | Y annotation, or None if not a union."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        left = _union_members(repo, module, node.left) or [node.left]
        right = _union_members(repo, module, node.right) or [node.right]
        return _dedupe(left + right)
    if isinstance(node, ast.Subscript):
        head = ast.unparse(node.value).split(".")[-1]
        if head == "Optional":
            inner = _union_members(repo, module, node.slice) or [node.slice]
            return _dedupe(inner + [ast.Constant(None)])
        if head == "Union":
            elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            res = []
            for e in elts:
                res += _union_members(repo, module, e) or [e]
            return _dedupe(res)
    return None


def _dedupe(nodes):
    seen, out = set(), []
    for n in nodes:
        k = ast.unparse(n)
        if k in ("None", "NoneType", "type(None)"):
            k = "None"
        if k not in seen:
            seen.add(k)
            out.append(n)
    return out


def _is_none(node) -> bool:
    return ast.unparse(node) in ("None", "NoneType", "type(None)")


def enum_members(repo: Repo, ref: ClassRef, _depth=0) -> list[str] | None:
    """Member names if `ref` is an Enum subclass (resolving bases), else None."""
    is_enum = False
    for b in ref.node.bases:
        txt = ast.unparse(b)
        if txt.split(".")[-1] in ("Enum", "IntEnum", "StrEnum", "Flag", "IntFlag"):
            is_enum = True
        elif _depth < 10:
            bref = resolve_name_in(repo, ref.module, b)
            if bref is not None and enum_members(repo, bref, _depth + 1) is not None:
                is_enum = True
    if not is_enum:
        return None
    names = []
    for stmt in ref.node.body:
        if isinstance(stmt, ast.Assign):
            for t in stmt.targets:
                if isinstance(t, ast.Name) and not t.id.startswith("_"):
                    names.append(t.id)
        elif (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and stmt.value
            and not stmt.target.id.startswith("_")
        ):
            names.append(stmt.target.id)
    return names


def extract_type(repo: Repo, module: str, node: ast.expr) -> dict:
    """Static mirror of ArgumentGroupFactory._extract_type; values are display strings."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):  # string annotation
        node = ast.parse(node.value, mode="eval").body
    members = _union_members(repo, module, node)
    if members is not None:
        if len(members) == 1:
            return extract_type(repo, module, members[0])
        if _is_none(members[1]):
            return extract_type(repo, module, members[0])
        raise TypeInferenceError(f"Unions not supported by argparse: {ast.unparse(node)}")
    if isinstance(node, ast.Subscript):
        head = ast.unparse(node.value).split(".")[-1]
        elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if head in ("list", "List"):
            if len(elts) == 1:
                kw = extract_type(repo, module, elts[0])
                kw["nargs"] = "+"
                return kw
            raise TypeInferenceError(f"Multi-type lists not supported: {ast.unparse(node)}")
        if head == "Literal":
            vals = [_literal(e) for e in elts]
            tname = type(vals[0]).__name__ if vals and vals[0] is not MISSING else "?"
            return {"type": tname, "choices": vals}
        raise TypeInferenceError(f"Unsupported type: {ast.unparse(node)}")
    if isinstance(node, (ast.Name, ast.Attribute)):
        ref = resolve_name_in(repo, module, node)
        if ref is not None:
            members = enum_members(repo, ref)
            if members is not None:
                return {"type": f"{ref.node.name}[name]", "choices": members, "_enum": True}
        return {"type": ast.unparse(node)}
    raise TypeInferenceError(f"Unsupported type: {ast.unparse(node)}")


@dataclass
class Arg:
    flags: list[str]
    group: str
    default: str
    kind: str  # action/type description
    dest: str
    source: str  # 'explicit' | 'dataclass:<Class>' | 'extra'
    lineinfo: str = ""
    help: str = ""


def fmt_value(v) -> str:
    if isinstance(v, ast.AST):
        lit = _literal(v)
        if lit is not MISSING:
            return repr(lit)
        return ast.unparse(v)
    if v is MISSING:
        return "<required>"
    return repr(v)


def field_docstrings(repo: Repo, ref: ClassRef, _depth=0) -> dict[str, str]:
    """Attribute docstrings (a string statement right after `name: type = ...`), own class
    first, then the first base recursively (as ArgumentGroupFactory._get_field_docstrings)."""
    out: dict[str, str] = {}
    body = ref.node.body
    for a, b in zip(body, body[1:], strict=False):
        if (
            isinstance(a, ast.AnnAssign)
            and isinstance(a.target, ast.Name)
            and isinstance(b, ast.Expr)
            and isinstance(b.value, ast.Constant)
            and isinstance(b.value.value, str)
        ):
            out[a.target.id] = " ".join(b.value.value.split())
    if ref.node.bases and _depth < 20:
        bref = resolve_name_in(repo, ref.module, ref.node.bases[0])
        if bref is not None:
            for k, v in field_docstrings(repo, bref, _depth + 1).items():
                out.setdefault(k, v)  # the subclass's own docstring wins (dict.update order)
    return out


def args_from_dataclass(
    repo: Repo, ref: ClassRef, exclude: set[str], group: str, warn
) -> list[Arg]:
    out = []
    fields = dataclass_fields(repo, ref)
    docs = field_docstrings(repo, ref)
    for fi in fields.values():
        if fi.name in exclude or not fi.init:
            continue
        owner_mod = fi.owner.module if fi.owner else ref.module
        names = ["--" + fi.name.replace("_", "-")]
        dest = fi.name
        if fi.default is MISSING and fi.default_factory is not MISSING:
            fac = fi.default_factory
            ftxt = ast.unparse(fac)
            default = {"list": "[]", "dict": "{}", "set": "set()", "tuple": "()"}.get(ftxt)
            if default is None:
                if isinstance(fac, ast.Lambda):
                    default = fmt_value(fac.body)
                else:
                    default = ftxt + "()"
        else:
            default = fmt_value(fi.default)
        meta = None
        if fi.metadata is not None and isinstance(fi.metadata, ast.Dict):
            for k, v in zip(fi.metadata.keys, fi.metadata.values, strict=False):
                if isinstance(k, ast.Constant) and k.value == "argparse_meta":
                    meta = v
        elif fi.metadata is not None:
            warn(f"{ref.node.name}.{fi.name}: non-literal metadata {ast.unparse(fi.metadata)}")
        kind: dict = {}
        try:
            kind = extract_type(repo, owner_mod, fi.annotation)
            if kind.get("type") == "bool":
                dflt_false = (
                    isinstance(fi.default, ast.Constant) and fi.default.value == False  # noqa: E712  (mirrors `attribute.default == False`)
                )
                kind["action"] = "store_true" if dflt_false else "store_false"
                kind.pop("type")
                if kind["action"] == "store_false":
                    names = [
                        "--no-" + fi.name.replace("_", "-"),
                        "--disable-" + fi.name.replace("_", "-"),
                    ]
        except TypeInferenceError as e:
            if meta is None:
                warn(f"{ref.node.name}.{fi.name}: {e} and no argparse_meta (Megatron would raise)")
                kind = {"type": "?" + ast.unparse(fi.annotation)}
        if meta is not None:
            if isinstance(meta, ast.Dict):
                for k, v in zip(meta.keys, meta.values, strict=False):
                    key = _literal(k)
                    if key == "arg_names":
                        names = list(_literal(v))
                    elif key == "dest":
                        dest = _literal(v)
                    elif key == "default":
                        default = fmt_value(v)
                    elif key in ("type",):
                        kind["type"] = ast.unparse(v)
                        kind.pop("_enum", None)
                    elif key in ("action",):
                        a = _literal(v)
                        kind["action"] = a if a is not MISSING else ast.unparse(v)
                        if kind["action"] in ("store_true", "store_false"):
                            kind.pop("type", None)
                    elif key == "choices":
                        c = _literal(v)
                        kind["choices"] = c if c is not MISSING else ast.unparse(v)
                    elif key == "nargs":
                        kind["nargs"] = _literal(v)
                    elif key == "help":
                        h = _literal(v)
                        docs[fi.name] = h if isinstance(h, str) else ast.unparse(v)
                    else:
                        kind[key] = fmt_value(v)
            else:
                warn(f"{ref.node.name}.{fi.name}: non-literal argparse_meta")
        if kind.get("action") in ("store_true", "store_false"):
            kind.pop("type", None)
        out.append(
            Arg(
                names,
                group,
                default,
                describe(kind, dest),
                dest,
                f"dataclass:{fi.owner.node.name if fi.owner else ref.node.name}",
                help=docs.get(fi.name, ""),
            )
        )
    return out


def describe(kind: dict, dest: str) -> str:
    parts = [kind.get("action") or "store"]
    if kind.get("type"):
        parts.append(f"type={kind['type']}")
    if kind.get("nargs") not in (None, MISSING):
        parts.append(f"nargs={kind['nargs']}")
    if kind.get("choices") not in (None, MISSING):
        ch = kind["choices"]
        if isinstance(ch, (list, tuple)):
            ch = "{" + ",".join(str(c) for c in ch) + "}"
        parts.append(f"choices={ch}")
    for k in ("const", "required", "metavar"):
        if k in kind:
            parts.append(f"{k}={kind[k]}")
    parts.append(f"dest={dest}")
    return " ".join(parts)
