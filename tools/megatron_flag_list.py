#!/usr/bin/env python3
"""List every command-line flag Megatron-LM's training parser defines, by static analysis.

Usage (regenerates the lists engine/config/megatron/ keeps; docs/megatron_flags.md):
    git -C MEGATRON_GIT archive core_v0.16.1 megatron pretrain_gpt.py | tar -x -C CHECKOUT
    python tools/megatron_flag_list.py CHECKOUT --label core_v0.16.1 \
        > engine/config/megatron/core_v0.16.1.tsv

MEGATRON_CHECKOUT is a plain directory holding megatron/training/arguments.py (and, for the
extras, pretrain_gpt.py). Nothing of Megatron-LM is imported or executed: the sources are read
with `ast` only (stdlib, Python 3.11).

Output: a header line starting with '#', then one line per option string, sorted:
    --flag-name<TAB>group<TAB>default<TAB>action/type

What is covered:
  * every `*.add_argument(...)` call inside the `_add_*` functions that
    `add_megatron_arguments()` calls, in order (the argument group title comes from the
    `parser.add_argument_group(title=...)` / `add_mutually_exclusive_group()` that the call is
    made on); calls under an `if` are marked `[if <test>]` in the group column;
  * every flag that `ArgumentGroupFactory(SomeConfig, exclude=[...]).build_group(parser, title)`
    generates from a dataclass (megatron/training/argument_utils.py): one flag per dataclass
    field (inherited fields included), `--field-name` with `_` -> `-`; `bool` fields become
    `store_true` when the default `== False`, otherwise `store_false` named `--no-<field>` and
    `--disable-<field>`; `Optional[X]`/`X | None` -> X, `list[X]` -> nargs='+',
    `Literal[...]` -> choices, Enum -> choices of member names; `field(metadata={"argparse_meta":
    {...}})` overrides all of it (incl. `arg_names`); `init=False` fields and the `exclude`
    list are skipped. The group column reads `<_add_fn>/<title> [<ConfigClass>]`;
  * argparse.BooleanOptionalAction adds the `--no-<flag>` form as its own line;
  * unless --no-extras: the flags of the `extra_args_provider=` that pretrain_gpt.py passes
    (ModelOpt's `add_modelopt_args`, only registered when nvidia-modelopt imports); their
    group column starts with `extra:`.
"""

from __future__ import annotations

import argparse
import ast
import os
import sys

from megatron_source_reading import (  # tools/, this script's folder
    MISSING,
    Arg,
    ClassRef,
    Repo,
    _literal,
    args_from_dataclass,
    dataclass_fields,
    describe,
    fmt_value,
    import_map,
    resolve_name_in,
    top_level_imports,
)

from engine.config.arguments import ArgumentParser

# ----------------------------------------------------------------------------------------------
# explicit add_argument calls
# ----------------------------------------------------------------------------------------------


def _flag_to_dest(flags: list[str]) -> str:
    long = [f for f in flags if f.startswith("--")]
    name = (long or flags)[0].lstrip("-")
    return name.replace("-", "_")


def explicit_arg(call: ast.Call, group: str) -> list[Arg]:
    flags = []
    for a in call.args:
        v = _literal(a)
        if isinstance(v, str):
            flags.append(v)
        else:
            flags.append("<non-literal:" + ast.unparse(a) + ">")
    kw = {k.arg: k.value for k in call.keywords if k.arg}
    action_node = kw.get("action")
    action = "store"
    if action_node is not None:
        lit = _literal(action_node)
        action = lit if isinstance(lit, str) else ast.unparse(action_node).replace("argparse.", "")
    dest = _literal(kw["dest"]) if "dest" in kw else _flag_to_dest(flags)
    if "default" in kw:
        default = fmt_value(kw["default"])
    elif action == "store_true":
        default = "False"
    elif action == "store_false":
        default = "True"
    else:
        default = "None"
    kind: dict = {"action": action}
    if "type" in kw:
        kind["type"] = ast.unparse(kw["type"])
    if "nargs" in kw:
        kind["nargs"] = fmt_value(kw["nargs"])
    if "choices" in kw:
        c = _literal(kw["choices"])
        kind["choices"] = c if c is not MISSING else ast.unparse(kw["choices"])
    for k in ("const", "required", "metavar"):
        if k in kw:
            kind[k] = fmt_value(kw[k])
    if "help" in kw and ast.unparse(kw["help"]) == "argparse.SUPPRESS":
        group = group + " (hidden: help=SUPPRESS)"
    help_txt = ""
    if "help" in kw:
        h = _literal(kw["help"])
        help_txt = h if isinstance(h, str) else ast.unparse(kw["help"])
    out = [
        Arg(
            flags,
            group,
            default,
            describe(kind, dest),
            dest,
            "explicit",
            f"line {call.lineno}",
            " ".join(help_txt.split()),
        )
    ]
    if action.endswith("BooleanOptionalAction"):
        neg = ["--no-" + f[2:] for f in flags if f.startswith("--")]
        out.append(
            Arg(
                neg,
                group,
                default,
                describe({**kind, "action": "BooleanOptionalAction(negative form)"}, dest),
                dest,
                "explicit",
                f"line {call.lineno}",
                " ".join(help_txt.split()),
            )
        )
    return out


# ----------------------------------------------------------------------------------------------
# walk an _add_* function
# ----------------------------------------------------------------------------------------------


class FunctionWalker:
    def __init__(
        self, repo: Repo, module: str, tree: ast.Module, fn: ast.FunctionDef, label: str, warn
    ):
        self.repo, self.module, self.tree, self.fn, self.label, self.warn = (
            repo,
            module,
            tree,
            fn,
            label,
            warn,
        )
        self.parents: dict[ast.AST, ast.AST] = {}
        for p in ast.walk(fn):
            for c in ast.iter_child_nodes(p):
                self.parents[c] = p
        self.local_imports = import_map(repo, module, fn.body)
        self.groups: dict[str, str] = {}  # var -> title
        self.factories: dict[str, tuple[ClassRef | None, set[str], str]] = {}
        self.assigns: dict[str, ast.expr] = {}
        self.args: list[Arg] = []
        self.dc_counts: list[tuple[str, int, int]] = []  # (class, fields, flags)

    def conditions(self, node) -> list[str]:
        conds = []
        cur = node
        while cur in self.parents and cur is not self.fn:
            par = self.parents[cur]
            if isinstance(par, ast.If):
                t = ast.unparse(par.test)
                conds.append(t if cur in par.body else f"not ({t})")
            cur = par
        return conds

    def title_of_call(self, call: ast.Call) -> str:
        for k in call.keywords:
            if k.arg == "title":
                return str(_literal(k.value))
        if call.args:
            return str(_literal(call.args[0]))
        return "?"

    def eval_list(self, node) -> set[str]:
        if isinstance(node, ast.Name) and node.id in self.assigns:
            return self.eval_list(self.assigns[node.id])
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return self.eval_list(node.left) | self.eval_list(node.right)
        lit = _literal(node)
        if isinstance(lit, (list, tuple, set)):
            return {x for x in lit if isinstance(x, str)}
        self.warn(f"{self.label}: cannot evaluate exclude list {ast.unparse(node)}")
        return set()

    def factory_from_call(self, call: ast.Call):
        cls_node = (
            call.args[0]
            if call.args
            else next((k.value for k in call.keywords if k.arg == "src_cfg_class"), None)
        )
        excl_node = (
            call.args[1]
            if len(call.args) > 1
            else next((k.value for k in call.keywords if k.arg == "exclude"), None)
        )
        ref = (
            resolve_name_in(self.repo, self.module, cls_node, self.local_imports)
            if cls_node is not None
            else None
        )
        if ref is None:
            name = ast.unparse(cls_node) if cls_node else "?"
            self.warn(f"{self.label}: cannot resolve dataclass {name}")
        excl = self.eval_list(excl_node) if excl_node is not None else set()
        return ref, excl, ast.unparse(cls_node) if cls_node is not None else "?"

    def is_factory_call(self, node) -> bool:
        return (
            isinstance(node, ast.Call)
            and ast.unparse(node.func).split(".")[-1] == "ArgumentGroupFactory"
        )

    def cond_suffix(self, node) -> str:
        conds = self.conditions(node)
        return "".join(f" [if {c}]" for c in reversed(conds))

    def run(self) -> list[Arg]:
        nodes = [n for n in ast.walk(self.fn) if isinstance(n, (ast.Assign, ast.Call))]
        nodes.sort(key=lambda n: (n.lineno, n.col_offset, 0 if isinstance(n, ast.Assign) else 1))
        for n in nodes:
            if isinstance(n, ast.Assign):
                for t in n.targets:
                    if isinstance(t, ast.Name):
                        self.assigns[t.id] = n.value
                v = n.value
                tgt = n.targets[0].id if isinstance(n.targets[0], ast.Name) else None
                if tgt is None or not isinstance(v, ast.Call):
                    continue
                fname = ast.unparse(v.func)
                if fname.endswith("add_argument_group"):
                    self.groups[tgt] = self.title_of_call(v)
                elif fname.endswith("add_mutually_exclusive_group"):
                    base = ast.unparse(v.func.value) if isinstance(v.func, ast.Attribute) else ""
                    self.groups[tgt] = self.groups.get(base, "(parser)") + " (mutually exclusive)"
                elif self.is_factory_call(v):
                    self.factories[tgt] = self.factory_from_call(v)
                elif fname.endswith(".build_group"):
                    self.groups[tgt] = self.title_of_call_build(v)
                continue
            call = n
            if not isinstance(call.func, ast.Attribute):
                continue
            attr = call.func.attr
            if attr == "add_argument":
                owner = ast.unparse(call.func.value)
                title = self.groups.get(owner, "(parser)" if owner == "parser" else f"?{owner}")
                group = f"{self.label}/{title}{self.cond_suffix(call)}"
                self.args += explicit_arg(call, group)
            elif attr == "build_group":
                recv = call.func.value
                if self.is_factory_call(recv):
                    ref, excl, cname = self.factory_from_call(recv)
                elif isinstance(recv, ast.Name) and recv.id in self.factories:
                    ref, excl, cname = self.factories[recv.id]
                else:
                    self.warn(f"{self.label}: build_group on unknown receiver {ast.unparse(recv)}")
                    continue
                title = self.title_of_call_build(call)
                group = f"{self.label}/{title} [{cname}]{self.cond_suffix(call)}"
                if ref is None:
                    continue
                made = args_from_dataclass(self.repo, ref, excl, group, self.warn)
                nfields = len(dataclass_fields(self.repo, ref))
                self.dc_counts.append((cname, nfields, len(made), len(excl)))
                self.args += made
            elif attr.startswith("_add_") or (isinstance(call.func, ast.Name)):
                pass
        # helper functions of the same module called with the parser/group (rare)
        for n in ast.walk(self.fn):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name):
                target = next(
                    (
                        s
                        for s in self.tree.body
                        if isinstance(s, ast.FunctionDef) and s.name == n.func.id
                    ),
                    None,
                )
                if target is not None and any(
                    "add_argument" in ast.unparse(x)
                    for x in ast.walk(target)
                    if isinstance(x, ast.Attribute)
                ):
                    self.warn(
                        f"{self.label}: calls helper {n.func.id} that adds arguments (walked)"
                    )
                    sub = FunctionWalker(
                        self.repo,
                        self.module,
                        self.tree,
                        target,
                        f"{self.label}>{target.name}",
                        self.warn,
                    )
                    self.args += sub.run()
                    self.dc_counts += sub.dc_counts
        return self.args

    def title_of_call_build(self, call: ast.Call) -> str:
        for k in call.keywords:
            if k.arg == "title":
                return str(_literal(k.value))
        if len(call.args) > 1:
            return str(_literal(call.args[1]))
        return "None"


# ----------------------------------------------------------------------------------------------
# driver
# ----------------------------------------------------------------------------------------------


def functions_called_by(fn: ast.FunctionDef) -> list[str]:
    names = []
    for stmt in fn.body:
        for n in ast.walk(stmt):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name):
                names.append(n.func.id)
    return names


def collect(root: str, extras: bool, warn) -> tuple[list[Arg], dict]:
    repo = Repo(root)
    module = "megatron.training.arguments"
    loaded = repo.load(module)
    if loaded is None:
        sys.exit(f"no megatron/training/arguments.py under {root}")
    _, tree = loaded
    funcs = {s.name: s for s in tree.body if isinstance(s, ast.FunctionDef)}
    entry = funcs.get("add_megatron_arguments")
    if entry is not None:
        order = [n for n in functions_called_by(entry) if n in funcs]
    else:  # older releases: parse_args calls the _add_* functions itself
        order = [n for n in functions_called_by(funcs["parse_args"]) if n.startswith("_add_")]
    stats = {"functions": order, "dataclass": [], "explicit_calls": 0, "extras": []}
    args: list[Arg] = []
    for name in order:
        w = FunctionWalker(repo, module, tree, funcs[name], name, warn)
        got = w.run()
        args += got
        stats["dataclass"] += [(name,) + c for c in w.dc_counts]
    uncalled = [
        n
        for n, f in funcs.items()
        if n.startswith("_add_")
        and n not in order
        and any(isinstance(x, ast.Attribute) and x.attr == "add_argument" for x in ast.walk(f))
    ]
    if uncalled:
        warn(f"_add_* functions with add_argument not called by add_megatron_arguments: {uncalled}")
    stats["uncalled"] = uncalled

    if extras:
        path = os.path.join(root, "pretrain_gpt.py")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as fh:
                ptree = ast.parse(fh.read())
            pimports = top_level_imports(repo, "pretrain_gpt", ptree)
            providers = set()
            for n in ast.walk(ptree):
                if isinstance(n, ast.keyword) and n.arg == "extra_args_provider":
                    for x in ast.walk(n.value):
                        if isinstance(x, ast.Name) and x.id in pimports:
                            providers.add(x.id)
            for p in sorted(providers):
                mod, orig = pimports[p]
                ld = repo.load(mod)
                if ld is None:
                    warn(f"extra_args_provider {p}: module {mod} not found")
                    continue
                fn = next(
                    (s for s in ld[1].body if isinstance(s, ast.FunctionDef) and s.name == orig),
                    None,
                )
                if fn is None:
                    continue
                label = f"extra:{orig}(pretrain_gpt.py extra_args_provider; only if it imports)"
                w = FunctionWalker(repo, mod, ld[1], fn, label, warn)
                got = w.run()
                args += got
                stats["extras"].append((mod, orig, len(got)))
        else:
            warn("pretrain_gpt.py not in checkout: extras skipped")
    stats["files_read"] = sorted(repo.files_read)
    return args, stats


def rows(args: list[Arg], with_help: bool = False) -> list[str]:
    out = []
    for a in args:
        for f in a.flags:
            row = f"{f}\t{a.group}\t{a.default}\t{a.kind}"
            if with_help:
                row += "\t" + a.help.replace("\t", " ")
            out.append(row)
    return sorted(out, key=lambda r: (r.split("\t")[0], r))


def main(argv=None) -> int:
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkout", help="path to a Megatron-LM checkout (plain directory)")
    ap.add_argument(
        "--no-extras", action="store_true", help="skip pretrain_gpt.py's extra_args_provider"
    )
    ap.add_argument("--debug", action="store_true", help="print warnings on stderr")
    ap.add_argument("--label", help="the release named in the header line (e.g. core_v0.16.1)")
    ap.add_argument("--with-help", action="store_true", help="add a 5th column: the help text")
    ns = ap.parse_args(argv)
    warnings: list[str] = []
    args, stats = collect(ns.checkout, not ns.no_extras, warnings.append)
    print(
        f"# Megatron-LM training flags of {ns.label or ns.checkout}, by tools/megatron_flag_list.py"
    )
    for r in rows(args, ns.with_help):
        print(r)
    if ns.debug:
        for w in warnings:
            print("[warn]", w, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
