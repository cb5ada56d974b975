"""The docs stay true: every config key, tool subcommand and option, repo path and link that README.md and
docs/*.md name exists. Fast (no training): keys come from train.Config's dataclasses, subcommands and options
from the tools' own argparse parsers, paths from the working tree."""

import argparse
import dataclasses
import glob
import os
import re
import sys
import typing

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import train  # noqa: E402

DOCS = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
TOOLS = ("bench", "download_data", "checkpoint_convert", "preflight")
# Not in the repo, made by a documented command (python download_tokenizer.py ... --tokenizer_path original).
MADE_BY_USER = {"assets/tokenizer/original/tokenizer.model"}
# Wrong on purpose: docs/internals.md's example of an abbreviation argparse refuses. And `--config` under
# torchtitan's name, an option of train.py that is no config key (pretrain/config.py).
NOT_A_KEY_ON_PURPOSE = {"--training.step", "--job.config_file"}


def config_keys() -> dict:
    """{section: {key, ...}} from train.Config's dataclasses."""
    # a section's fields, or those of its tables' dataclass for top-level tables ([[phases]])
    return {s.name: {f.name for f in dataclasses.fields(typing.get_args(s.type)[0] if typing.get_args(s.type) else s.type)}
            for s in dataclasses.fields(train.Config)}


class _Parsed(Exception):
    def __init__(self, parser):
        self.parser = parser


def tool_parser(tool: str) -> argparse.ArgumentParser:
    """The tool's own top-level parser, caught as it is about to parse (no tool exposes all of them)."""
    def grab(self, *args, **kwargs):
        raise _Parsed(self)

    saved = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
    argparse.ArgumentParser.parse_args = argparse.ArgumentParser.parse_known_args = grab
    try:
        module = __import__(tool)
        {"bench": lambda: module.main([]), "preflight": lambda: module.main([]), "download_data": lambda: module.main([]),
         "checkpoint_convert": lambda: module.main([])}[tool]()
    except _Parsed as got:
        return got.parser
    finally:
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = saved
    raise AssertionError(f"{tool}.py built no parser")


def subcommands(parser) -> dict:
    """{name: subparser}; empty for a tool without subcommands (download_data.py)."""
    return {name: p for a in parser._actions if isinstance(a, argparse._SubParsersAction) for name, p in a.choices.items()}


def code(text: str) -> list:
    """Fenced blocks and inline `spans`: where commands and paths are written."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M)
    rest = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.S | re.M)
    return blocks + re.findall(r"`([^`\n]+)`", rest)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def expand(path: str) -> list:
    """configs/llama3_{1b,8b}.toml -> both names."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [q for alt in m[1].split(",") for q in expand(path[:m.start()] + alt + path[m.end():])]


def exists(path: str) -> bool:
    return all(glob.glob(os.path.join(ROOT, p)) for p in expand(path))


def problems(name: str, text: str, keys: dict, parsers: dict) -> list:
    """Every false reference in one markdown file, as 'file: what'."""
    out = []
    # --section.key anywhere (prose, tables, code): a real key of a real section
    for section, key in re.findall(r"(?<![\w-])--([a-z_][a-z0-9_]*)\.([a-z_][a-z0-9_]*)", text):
        if key not in keys.get(section, ()) and section != "section" and f"--{section}.{key}" not in NOT_A_KEY_ON_PURPOSE:
            out.append(f"{name}: --{section}.{key} is not a config key (python train.py --help)")
    snippets = code(text)
    # `[section] key` in code: a real key of that section
    for snippet in snippets:
        for section, key in re.findall(r"(?<!\[)\[([a-z_][a-z0-9_]*)\]\s+([a-z_][a-z0-9_]*)", snippet):
            if section in keys and key not in keys[section]:
                out.append(f"{name}: [{section}] {key} is not a config key")
    # tool.py SUBCOMMAND --option ...: the subcommand and every option exist in the tool's parser
    for snippet in snippets:
        for tool, tail in re.findall(r"(?<![\w/])(" + "|".join(TOOLS) + r")\.py((?:[^\n`|#;&]|\\\n)*)", snippet):
            parser, words = parsers[tool], [w.strip("[]") for w in tail.split()]
            subs = subcommands(parser)
            if subs and words and not words[0].startswith("-") and not words[0].isupper():
                if words[0] not in subs:
                    out.append(f"{name}: {tool}.py has no subcommand {words[0]!r} (it has {sorted(subs)})")
                    continue
                parser = subs[words[0]]
            for word in words:
                option = word.partition("=")[0]
                if not option.startswith("--") or "." in option or option[2:] in keys:
                    continue  # a value, or a train.py config key passed on (checked above), or --phases
                if option not in parser._option_string_actions:
                    out.append(f"{name}: {tool}.py{' ' + words[0] if subs else ''} has no option {option}")
    # repo paths named anywhere: configs/..., slurm/..., tests/..., assets/..., docs/..., .ci/..., pretrain/...,
    # top-level files
    paths = re.findall(r"(?<![\w./@-])((?:configs|slurm|tests|assets|docs|\.ci|pretrain)/[\w./{},*<>-]*)", text)
    paths += re.findall(r"(?<![\w./-])((?:[a-z_]+\.py|requirements[\w-]*\.txt|pytest\.ini|LICENSE))(?![\w/])", text)
    for path in {p.rstrip(".,") for p in paths}:
        if "<" not in path and path not in MADE_BY_USER and not exists(path):
            out.append(f"{name}: {path} does not exist")
    # relative markdown links, and their #anchors
    for target, anchor in re.findall(r"\]\((?!https?:)([^)#\s]*)(?:#([^)\s]*))?\)", text):
        path = os.path.normpath(os.path.join(os.path.dirname(name), target)) if target else name
        if not os.path.exists(os.path.join(ROOT, path)):
            out.append(f"{name}: link to {target} that does not exist")
        elif anchor and path.endswith(".md"):
            headings = re.findall(r"^#+ (.*)$", open(os.path.join(ROOT, path)).read(), re.M)
            if anchor not in {slug(h) for h in headings}:
                out.append(f"{name}: link to {path}#{anchor}: no such heading")
    return out


@pytest.fixture(scope="module")
def refs():
    return config_keys(), {tool: tool_parser(tool) for tool in TOOLS}


def test_every_key_subcommand_path_and_link_in_the_docs_exists(refs):
    assert len(DOCS) >= 6, DOCS  # README.md and docs/*.md
    found = [p for name in DOCS for p in problems(name, open(os.path.join(ROOT, name)).read(), *refs)]
    assert not found, "\n".join(found)


def test_a_typo_is_caught(refs):
    keys, parsers = refs
    assert {"overhead", "memory", "titan"} <= set(subcommands(parsers["bench"]))  # read from the parser
    assert {"torch2dcp", "dcp2hf"} <= set(subcommands(parsers["checkpoint_convert"]))
    good = ("`--training.steps 10`, `[checkpoint] enable = true`, `python bench.py memory --world_size 8`, "
            "`python bench.py loader --show 2`, `checkpoint_convert.py dcp2torch --dtype bfloat16`, `configs/debug_model.toml`, "
            "`configs/llama3_{1b,8b}.toml`, `slurm/env/<name>.sh`, `bench.py`, [x](docs/slurm.md#resizing)")
    assert problems("README.md", good, keys, parsers) == []
    for typo in ["`--training.stpes 10`", "--trainng.steps", "`[checkpoint] enabled = true`",
                 "`python bench.py memroy`", "`python bench.py memory --world-size 8`", "`python bench.py loader --shows 2`",
                 "`python download_data.py --data.sead 1`", "`checkpoint_convert.py dcp2torh`", "`checkpoint_convert.py dcp2hf --dtype x`",
                 "`configs/llama3_8.toml`", "`configs/llama3_{1b,9b}.toml`", "see tests/test_nothing.py", "`trian.py`",
                 "`checkpoint.py`", "`pretrain/checkpoints.py`",
                 "[x](docs/slurn.md)", "[x](docs/slurm.md#resising)", "[x](#no-such-heading)"]:
        assert problems("README.md", typo, keys, parsers), typo


# --- Each measured figure stands once, in docs/performance.md, in a table that names its machine, date and
# command; other pages link there. A figure: a number with a decimal point or a thousands separator, of three
# digits or more. These are settings, sizes and versions that any page may name, not measurements.
FIGURE = re.compile(r"(?<![\w.,])(\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+\.\d+)(?![\w]|[.,]\d)")
NOT_FIGURES = {"1,024", "2,048", "4,096", "8,192", "16,384", "128,256", "131,072", "1,000", "2,000", "4,000",
               "3.11", "3.12", "2.11", "2.13", "2.15", "0.18", "1.25", "1.15"}
READ_WITH_FIGURES = ["docs/performance.md"]


def significant(number: str) -> int:
    """Its significant digits: 0.959 has 3, 1.00 and 0.15 have 1 and 2."""
    digits = number.replace(",", "")
    if "." in digits:
        digits = digits.rstrip("0").rstrip(".")
    return len(digits.replace(".", "").lstrip("0"))


def figures(text: str) -> set:
    return {f for f in FIGURE.findall(text) if significant(f) >= 3} - NOT_FIGURES


def copied(name: str, text: str, measured: set) -> list:
    """'file: figure' for each figure of performance.md that `text` repeats."""
    return [f"{name}: {f}" for f in sorted(figures(text) & measured)]


def test_each_figure_stands_once_in_performance_md():
    measured = figures(open(os.path.join(ROOT, "docs", "performance.md")).read())
    assert {"51,250", "47.1", "1.015", "0.959"} <= measured  # what the rule protects
    elsewhere = [p for p in DOCS if p not in READ_WITH_FIGURES]
    elsewhere += sorted(os.path.relpath(p, ROOT) for pattern in ("*.py", "pretrain/*.py", "slurm/*.py", "tests/*.py",
                                                                 "configs/*.toml")
                        for p in glob.glob(os.path.join(ROOT, pattern)))
    found = [c for name in elsewhere if name != "tests/test_docs.py"
             for c in copied(name, open(os.path.join(ROOT, name)).read(), measured)]
    assert not found, "figures copied out of docs/performance.md (link to it instead): " + ", ".join(found)
    assert copied("README.md", "1B: 51,250 tokens/s, 47.1% MFU", measured) == ["README.md: 47.1", "README.md: 51,250"]
    assert copied("README.md", "vocabulary 128,256, torch 2.13, 0.2.2", measured) == []


def test_the_code_points_at_headings_that_exist():
    """`docs/X.md#heading` in a docstring, comment or error line: the page and the heading exist."""
    code = [os.path.relpath(p, ROOT) for pattern in ("*.py", "pretrain/*.py", "slurm/*", "tests/*.py")
            for p in glob.glob(os.path.join(ROOT, pattern)) if os.path.isfile(p)]
    code.remove(os.path.join("tests", "test_docs.py"))  # its typos are on purpose
    found = []
    for name in code:
        for page, anchor in re.findall(r"docs/(\w+\.md)(?:#([\w-]+))?", open(os.path.join(ROOT, name)).read()):
            path = os.path.join(ROOT, "docs", page)
            if not os.path.exists(path):
                found.append(f"{name}: docs/{page} does not exist")
            elif anchor and anchor not in {slug(h) for h in re.findall(r"^#+ (.*)$", open(path).read(), re.M)}:
                found.append(f"{name}: docs/{page}#{anchor}: no such heading")
    assert not found, "\n".join(found)


def test_the_requirements_name_every_package_the_code_imports():
    """A package the code imports is pinned in a requirements file by its own name, not only reached through
    another's dependencies (tqdm came with datasets, tokenizers with transformers, a test requirement): a new
    release of the other may drop it."""
    import ast
    from importlib.metadata import packages_distributions
    files = glob.glob(os.path.join(ROOT, "*.py")) + glob.glob(os.path.join(ROOT, "pretrain", "*.py"))
    files += glob.glob(os.path.join(ROOT, "slurm", "*.py")) + glob.glob(os.path.join(ROOT, "assets", "*.py"))
    ours = {os.path.basename(f)[:-3] for f in files} | {"pretrain"}
    imported = set()
    for path in files:
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                imported.add(node.module.split(".")[0])
    third_party = imported - set(sys.stdlib_module_names) - ours
    pinned = set()
    for name in ("requirements.txt", "requirements-dev.txt", "requirements-bench.txt"):
        for line in open(os.path.join(ROOT, name)):
            if m := re.match(r"([A-Za-z0-9_.-]+)(\[[\w,]+\])?==", line):
                pinned.add(m[1].lower().replace("_", "-"))
    if "torch==" in open(os.path.join(ROOT, ".ci", "run")).read():  # installed first, for its platform
        pinned.add("torch")
    distributions = packages_distributions()
    missing = []
    for module in sorted(third_party):
        names = {d.lower().replace("_", "-") for d in distributions.get(module, [module])}
        if not names & pinned:
            missing.append(f"{module} ({', '.join(sorted(names))})")
    assert not missing, f"imported but not pinned in a requirements file: {missing}"
