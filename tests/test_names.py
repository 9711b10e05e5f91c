"""Every dotted name of this project that the README, the docs or a
docstring or comment gives (``dsq_plugins.…``, ``horovod_ext.…``,
``deepspeed_ext.…``, ``robust.…``) names something that exists: a module
that imports and the attributes after it. Names go stale when code moves;
a reader who follows one should land somewhere."""
import ast
import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("dsq_plugins", "horovod_ext", "deepspeed_ext", "robust")
# (not a file's path: docs/results/robust.md is no dotted name)
DOTTED = re.compile(r"(?<![/\w.-])((?:" + "|".join(PACKAGES) + r")(?:\.[A-Za-z_][A-Za-z0-9_]*)+)")
SKIPPED_DIRS = {".venv", ".git", "runs", "build", "dist", "_build"}


def sources() -> list[pathlib.Path]:
    return sorted(p for p in ROOT.rglob("*") if p.suffix in (".py", ".md", ".rst") and p.is_file()
                  and not SKIPPED_DIRS & set(p.relative_to(ROOT).parts) and "egg-info" not in str(p))


def resolves(name: str) -> bool:
    """Whether the longest importable prefix of ``name`` has the attributes that follow it."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError as exc:
            if exc.name and exc.name.split(".")[0] not in PACKAGES:  # an engine not installed here
                pytest.skip(f"{name}: {exc.name} is not installed")
            continue
        for attribute in parts[i:]:
            if not hasattr(obj, attribute):
                return False
            obj = getattr(obj, attribute)
        return True
    return False


def test_every_dotted_name_in_the_docs_and_the_code_resolves():
    stale: dict[str, list[str]] = {}
    for path in sources():
        for match in DOTTED.finditer(path.read_text(errors="replace")):
            name = match.group(1)
            if name not in stale and not resolves(name):
                stale.setdefault(name, []).append(str(path.relative_to(ROOT)))
            elif name in stale:
                stale[name].append(str(path.relative_to(ROOT)))
    assert not stale, "names that no longer exist: " + "; ".join(f"{n} (in {', '.join(sorted(set(f))[:3])})"
                                                                 for n, f in sorted(stale.items()))


#: what a measured figure looks like in prose: a percentage, a ratio (×), a time
FIGURE = re.compile(r"\d+(?:\.\d+)?\s?%|\d+(?:\.\d+)?×|\d+(?:\.\d+)? ?(?:ms|us|µs)\b")


def test_no_module_docstring_carries_a_measured_figure():
    """Code says why and points to the study; the figures live in docs/results/, where they are kept current."""
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            found += [f"{path.relative_to(ROOT)}: {line.strip()}" for line in doc.splitlines() if FIGURE.search(line)]
    assert not found, "\n".join(found)


LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def anchors(path: pathlib.Path) -> set[str]:
    """The heading anchors of a Markdown file, as GitHub and the docs site make them."""
    from mdit_py_plugins.anchors.index import slugify
    found, fence = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and re.match(r"#{1,6} ", line):
            found.add(slugify(line.lstrip("#").strip()))
    return found


def test_every_link_in_the_readme_resolves():
    """Files the README links to exist, and so do the headings its anchors name."""
    pytest.importorskip("mdit_py_plugins")
    readme = ROOT / "README.md"
    broken = []
    for target in LINK.findall(readme.read_text()):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked here (no network)
            continue
        path, _, anchor = target.partition("#")
        file = readme if not path else (ROOT / path)
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(target)
    assert not broken, f"links in the README that lead nowhere: {broken}"


#: the names the guides import the packages as
ALIASES = {"dsq": "dsq_plugins", "dsq_ddp": "dsq_plugins.ddp", "dsq_fsdp": "dsq_plugins.fsdp", "hx": "horovod_ext",
           "dx": "deepspeed_ext", "deepspeed_ext": "deepspeed_ext", "robust": "robust"}


def python_blocks(path: pathlib.Path) -> list[str]:
    """The ```python blocks of a Markdown file."""
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def test_the_guides_code_parses_and_names_what_exists():
    """A guide's quickstart is a file a test runs (test_quickstart); its other
    snippets are read, not run: each must still be Python, and every name it
    takes from this project (``dsq.X``, ``dsq_ddp.X``, ``hx.X`` ...) must exist."""
    problems = []
    for path in sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]:
        if "_build" in path.parts:
            continue
        for code in python_blocks(path):
            try:
                ast.parse(code)
            except SyntaxError as exc:
                problems.append(f"{path.relative_to(ROOT)}: not Python ({exc.msg}, line {exc.lineno})")
                continue
            for alias, name in re.findall(r"(?<![\w.])(" + "|".join(ALIASES) + r")\.([A-Za-z_]\w*)", code):
                if not resolves(f"{ALIASES[alias]}.{name}"):
                    problems.append(f"{path.relative_to(ROOT)}: {alias}.{name} does not exist")
    assert not problems, "\n".join(problems)
