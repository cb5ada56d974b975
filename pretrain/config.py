"""train.py's config plumbing: TOML files and `--section.key value` options for its dataclasses.

train.py holds the dataclasses (what a run can set, each field with its one-line doc, each section's
RULES for its values); this file reads them and applies the rules. Precedence: command line > TOML
file > defaults. Unknown sections and keys, and values of the wrong type: a ConfigError naming the
close matches."""

import argparse
import contextlib
import ast
import dataclasses
import difflib
import inspect
import io
import json
import math
import textwrap
import tokenize
import tomllib
import typing


class ConfigError(ValueError):
    """A user mistake in the config, the command line or an input file: one line, exit code 2."""


# A field's rule, in its section's RULES beside the fields: (check, what the value must be). NaN fails
# every comparison, so it is caught too. check_rules() applies them; a rule across sections (the layout,
# a source's files) is the program's own.
AT_LEAST_1 = (lambda x: x >= 1, ">= 1")
NON_NEGATIVE = (lambda x: x >= 0, ">= 0")
POSITIVE = (lambda x: 0 < x < math.inf, "a positive number")
MINUS_1_OR_AT_LEAST_1 = (lambda x: x == -1 or x >= 1, "-1 or >= 1")


def one_of(*names) -> tuple:
    return (lambda x: x in names, f"one of {', '.join(names)}")


def check_rules(cfg) -> None:
    """Every section's RULES, in the config's order: a ConfigError naming the first bad value."""
    for section in dataclasses.fields(cfg):
        obj = getattr(cfg, section.name)
        for key, (ok, allowed) in getattr(obj, "RULES", {}).items():
            value = getattr(obj, key)
            if not ok(value):
                raise ConfigError(f"{section.name}.{key} = {value!r}: must be {allowed}")


def _docs(cls) -> dict:
    """Each field's one-line doc: the `# comment` on its line (or a multi-line default's lines),
    else a comment line just above it. A field without one gets "" (--help shows its default)."""
    try:
        src = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source file (a notebook cell's class) means no docs, no crash
        return {}
    lines = src.splitlines()
    tokens = tokenize.generate_tokens(io.StringIO(src).readline)
    comments = {t.start[0]: t.string.lstrip("#").strip()  # line number -> comment text
                for t in tokens if t.type == tokenize.COMMENT}
    docs = {}
    for node in ast.parse(src).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            own = [comments[i] for i in range(node.lineno, node.end_lineno + 1) if i in comments]
            above = node.lineno - 1 if lines[node.lineno - 2].lstrip().startswith("#") else None
            docs[node.target.id] = own[-1] if own else comments.get(above, "")
    return docs


def _convert(value, typ, where: str):
    """Check/convert a TOML value or a CLI string to the field's type: list is a list of strings,
    list[float] one of numbers ([muon] ns_coefficients)."""
    item = float if typing.get_args(typ) == (float,) else str
    typ = typing.get_origin(typ) or typ
    if typ is list and isinstance(value, str):  # --model.converters a,b ([] for none)
        value = [s.strip(" '\"") for s in value.strip("[]").split(",") if s.strip(" '\"")]
        with contextlib.suppress(ValueError):  # --muon.ns_coefficients 3.4,-4.8,2
            value = [float(s) for s in value] if item is float else value
    elif isinstance(value, str) and typ is not str:  # from the command line
        try:
            value = {"true": True, "false": False}[value.lower()] if typ is bool else typ(value)
        except (KeyError, ValueError):
            raise ConfigError(f"{where}: expected {typ.__name__}, got {value!r}")
    if typ in (float, str) and isinstance(value, int) and not isinstance(value, bool):
        value = typ(value)  # lr = 1 reads as 1.0; selective_ac_option = 2 as "2"
    if typ is list and item is float and isinstance(value, list) and not any(isinstance(s, bool) for s in value):
        value = [float(s) if isinstance(s, int) else s for s in value]  # [3, -4, 2] reads as floats
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)) or (
            typ is list and not all(isinstance(s, item) for s in value)):
        kind = "list of numbers" if item is float else typ.__name__
        raise ConfigError(f"{where}: expected {kind}, got {value!r}")
    return value


def unknown(kind: str, name: str, known) -> ConfigError:
    return ConfigError(f"unknown {kind} {name!r}{_hint(name, known)}")


def _hint(name: str, known) -> str:
    close = difflib.get_close_matches(name, list(known), n=3)
    return f"; did you mean {', '.join(close)}?" if close else f"; valid: {', '.join(known)}"


def _set(cfg, section: str, key: str, value, where: str):
    sections = {f.name: f for f in dataclasses.fields(cfg)}
    if section not in sections:
        raise unknown("config section", section, sections)
    if _table_type(typing.get_type_hints(type(cfg))[section]):  # [[phases]]
        raise ConfigError(f"{where}: {section} is set by [[{section}]] tables in the TOML file only")
    obj = getattr(cfg, section)
    keys = {f.name: f for f in dataclasses.fields(obj)}
    if key in getattr(obj, "RENAMED", {}):  # a renamed key: name its successor, not a close match
        raise ConfigError(f"[{section}] {key} was replaced by {obj.RENAMED[key]}")
    if key not in keys:
        raise unknown(f"key in [{section}]", key, keys)
    typ = typing.get_type_hints(type(obj))[key]
    if _table_type(typ):
        value = _tables(value, _table_type(typ), where, f"{section}.{key}")
    else:
        value = _convert(value, typ, f"{where} {section}.{key}")
    setattr(obj, key, value)


def _table_type(typ):
    """The dataclass of a field annotated list[SomeDataclass] (TOML tables), else None."""
    args = typing.get_args(typ)
    tables = typing.get_origin(typ) is list and args and dataclasses.is_dataclass(args[0])
    return args[0] if tables else None


def _tables(value, cls, where: str, name: str) -> list:
    """[[section.key]] tables -> instances of cls, each key checked against cls's fields' types."""
    if not isinstance(value, list) or not value or not all(isinstance(t, dict) for t in value):
        raise ConfigError(f"{where}: {name} must be one or more [[{name}]] tables")
    hints = typing.get_type_hints(cls)
    out = []
    for n, table in enumerate(value):
        for k, v in table.items():
            if k not in hints:
                raise ConfigError(f"{where}: unknown key {k!r} in [[{name}]] {n}{_hint(k, hints)}")
            # an Optional[str] converts as str
            typ = next((t for t in typing.get_args(hints[k]) if t is not type(None)), hints[k])
            table = {**table, k: _convert(v, typ, f"{where} {name}[{n}].{k}")}
        try:
            out.append(cls(**table))
        except (TypeError, ValueError) as e:  # the dataclass's own checks
            raise ConfigError(f"{where}: [[{name}]] {n}: {e}")
    return out


def build_parser(config_cls, description: str, with_docs: bool = True) -> argparse.ArgumentParser:
    """--section.key for every config field (generated from the dataclasses), plus --config;
    `with_docs`: field docs in its help (read from the source: 0.2 s, so only for --help)."""
    def wide(prog):
        return argparse.RawDescriptionHelpFormatter(prog, max_help_position=60, width=200)

    usage = "%(prog)s [--config TOML] [--section.key VALUE ...]"
    parser = argparse.ArgumentParser(usage=usage, description=description, allow_abbrev=False,
                                     exit_on_error=False, formatter_class=wide)
    parser.add_argument("--config", "--job.config_file", action="append", metavar="TOML",
                        help="the TOML config file")
    lists = [f.name for f in dataclasses.fields(config_cls)
             if _table_type(typing.get_type_hints(config_cls)[f.name])]  # [[phases]]
    docs = _docs(config_cls) if with_docs else {}
    for k in lists:  # set in the TOML; dropped, all of them, by --phases none
        parser.add_argument(f"--{k}", choices=["none"], default=argparse.SUPPRESS,
                            help=f"[[{k}]] tables (TOML only): {docs.get(k, '')}; none: without them")
    for sec in dataclasses.fields(config_cls):
        if sec.name in lists:
            continue
        cls = type(getattr(config_cls(), sec.name))
        docs = _docs(cls) if with_docs else {}
        hints = typing.get_type_hints(cls)
        tables = [f"[[{sec.name}.{k}]] (TOML only): {docs.get(k, '')}"
                  for k in hints if _table_type(hints[k])]
        group = parser.add_argument_group(f"[{sec.name}]", "\n".join(tables) or None)
        for f in dataclasses.fields(cls):
            typ = hints[f.name]
            if _table_type(typ):
                continue  # tables are set in TOML only
            bare = {"nargs": "?", "const": "true"} if typ is bool else {}  # --checkpoint.enable
            doc = f"{docs.get(f.name, '')} (default: {getattr(cls(), f.name)!r})".lstrip()
            group.add_argument(f"--{sec.name}.{f.name}", default=argparse.SUPPRESS,
                               metavar=typ.__name__.upper(), help=doc, **bare)
    return parser


def load(config_cls, argv, description: str = ""):
    """Defaults, then the TOML file (--config), then --section.key value overrides."""
    try:
        with_docs = {"-h", "--help"} & set(argv)
        args, unknown = build_parser(config_cls, description, with_docs).parse_known_args(argv)
    except argparse.ArgumentError as e:
        raise ConfigError(str(e))
    for arg in unknown:  # argparse would say "unrecognized arguments": name close matches instead
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; options look like --section.key value")
        section, dot, key = arg[2:].partition("=")[0].partition(".")
        if not dot:
            raise ConfigError(f"option {arg}: expected --section.key (e.g. --training.steps)")
        _set(config_cls(), section, key, None, "command line")  # unknown keys and tables raise
    cfg = config_cls()
    hints = typing.get_type_hints(config_cls)
    lists = [k for k, typ in hints.items() if _table_type(typ)]  # top-level tables: [[phases]]
    files = args.config or []
    if len(files) > 1:
        raise ConfigError(f"--config given {len(files)} times ({', '.join(files)}); "
                          "give one file and override single keys with --section.key value")
    for path in files:
        try:
            with open(path, "rb") as f:
                toml = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file {path!r} not found")
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path!r} is not valid TOML: {e}")
        for section, table in toml.items():
            if _table_type(hints.get(section)):  # top-level [[tables]] ([[phases]]): a list
                setattr(cfg, section, _tables(table, _table_type(hints[section]), path, section))
                continue
            if not isinstance(table, dict):
                raise ConfigError(f"{path}: {section!r} must be a [section] table")
            for key, value in table.items():
                _set(cfg, section, key, value, path)
    for name, value in vars(args).items():
        if name in lists:  # --phases none
            setattr(cfg, name, [])
        elif name != "config":
            _set(cfg, *name.split(".", 1), value, "command line")
    return cfg


def to_toml(cfg) -> str:
    """The resolved config as TOML that --config accepts back (None values are left out)."""
    def fmt(v):
        if isinstance(v, dict):  # an inline table: [[phases]] weights
            return "{" + ", ".join(f"{json.dumps(k)} = {fmt(x)}" for k, x in v.items()) + "}"
        return json.dumps(v) if not isinstance(v, bool) else str(v).lower()
    out = []
    for f in dataclasses.fields(cfg):
        sec = getattr(cfg, f.name)
        if isinstance(sec, list):  # top-level [[tables]], after the sections (TOML's rule)
            continue
        out.append(f"[{f.name}]")
        hints = typing.get_type_hints(type(sec))
        tables = {k for k in hints if _table_type(hints[k])}
        values = dataclasses.asdict(sec)
        out += [f"{k} = {fmt(v)}" for k, v in values.items() if k not in tables and v is not None]
        for k in tables:
            for item in getattr(sec, k):
                out.append(f"\n[[{f.name}.{k}]]")
                fields = dataclasses.asdict(item)
                out += [f"{name} = {fmt(v)}" for name, v in fields.items() if v is not None]
        out.append("")
    for f in dataclasses.fields(cfg):
        for item in getattr(cfg, f.name) if isinstance(getattr(cfg, f.name), list) else ():
            out.append(f"[[{f.name}]]")
            out += [f"{name} = {fmt(v)}" for name, v in dataclasses.asdict(item).items()]
            out.append("")
    return "\n".join(out)
