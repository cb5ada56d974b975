"""The code stays readable as written: each file within its size budget from DESIGN.md (a file far over it is
usually doing two jobs), the tools' lines of at most 120 characters, one module per `import` line, train.main()
in one sitting, and a README read in ten minutes."""

import ast
import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Lines at most, from DESIGN.md's file table.
BUDGETS = {"train.py": 900, "model.py": 350, "data.py": 550, "download_data.py": 200, "sources.py": 450,
           "data_manifest.py": 250, "mirror.py": 150, "bench.py": 600, "measure.py": 150, "preflight.py": 450, "checkpoint.py": 240,
           "checkpoint_folder.py": 220, "titan_layout.py": 100, "hf_layout.py": 140, "checkpoint_convert.py": 400,
           "download_tokenizer.py": 80, "metrics.py": 120, "memory.py": 225, "config.py": 200, "dryrun.py": 300,
           "evals.py": 300, "float8.py": 150, "distributed.py": 200, "data_check.py": 200, "titan_run.py": 140}
# memory.py: 150 for the estimate, plus the live count the dry run reports (LiveStorages, from dryrun.py)
# and the peak RSS train.py logs on CPU (peak_resident_bytes).
TOOLS = sorted(glob.glob(os.path.join(ROOT, "*.py")))  # what a user reads and forks
CODE = TOOLS + sorted(glob.glob(os.path.join(ROOT, "tests", "*.py")) + glob.glob(os.path.join(ROOT, "assets", "*.py")))
# A config dataclass field with its --help doc may run longer: `    name: type = default  # doc`.
FIELD_DOC = re.compile(r"^\s+\w+: [^=]+ = .*  # ")


def read(path):
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


@pytest.mark.parametrize("name", sorted(BUDGETS))
def test_each_file_within_its_budget(name):
    if not os.path.exists(os.path.join(ROOT, name)):
        pytest.skip(f"{name} does not exist")
    assert len(read(name).splitlines()) <= BUDGETS[name]


def test_code_lines_are_short_and_imports_one_per_line():
    long, multi = [], []
    for path in CODE:
        for n, line in enumerate(read(path).splitlines(), 1):
            where = f"{os.path.relpath(path, ROOT)}:{n}"
            if path in TOOLS and len(line) > 120 and not FIELD_DOC.match(line):
                long.append(where)
            if re.match(r"\s*import \w[\w.]*( as \w+)?,", line):
                multi.append(where)
    assert not long, f"lines over 120 characters: {long}"
    assert not multi, f"several modules on one import line: {multi}"


def test_train_main_reads_in_one_sitting():
    main = next(n for n in ast.parse(read("train.py")).body if isinstance(n, ast.FunctionDef) and n.name == "main")
    assert main.end_lineno - main.lineno + 1 <= 180


def test_readme_reads_in_ten_minutes():
    assert len(read("README.md").split()) <= 2000


# Programs (files you run) on top, libraries below: a library never imports a program or train.py (DESIGN.md).
PROGRAMS = {"train", "bench", "preflight", "dryrun", "checkpoint_convert", "download_data", "download_tokenizer",
            "titan_run"}
LIBRARIES = {"measure", "model", "config", "sources", "data_manifest", "mirror", "data", "evals", "checkpoint", "titan_layout",
             "checkpoint_folder", "hf_layout", "metrics", "float8", "memory", "distributed", "data_check"}


def imports(name: str) -> set:
    """The repository's modules that `name`.py imports, anywhere in the file (a late import counts too)."""
    found = set()
    for node in ast.walk(ast.parse(read(f"{name}.py"))):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found & (PROGRAMS | LIBRARIES)


def test_libraries_never_import_programs_and_nothing_imports_bench():
    every = {os.path.basename(p)[:-3] for p in TOOLS} - {"conftest", "test_smoke"}
    assert every == PROGRAMS | LIBRARIES, "a new file: add it to PROGRAMS or LIBRARIES (and DESIGN.md's table)"
    up = {f"{lib}.py imports {imported}.py" for lib in LIBRARIES for imported in imports(lib) & PROGRAMS}
    assert not up, sorted(up)
    assert not [name for name in every if "bench" in imports(name) and name != "bench"]
