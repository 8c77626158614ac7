"""The docs hold together: a short front door, no development history, no
broken links.

- README.md is the front door: at most 150 lines; docs/benchmarks.md at
  most 450 (figures with their commands, not a journal).
- README.md, docs/*.md, CHANGELOG.md and kvtier's own source say what is
  true now: no dates, no local paths, no design notes outside the product,
  no issue numbers, no numbered development sessions (git keeps history).
- Every relative link in README.md and docs/*.md names a file that exists,
  and every ``#anchor`` a heading of that file, slugged as GitHub slugs
  them.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def rel(p: Path) -> str:
    return p.relative_to(ROOT).as_posix() if p.is_relative_to(ROOT) else p.name


def lines_of(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_readme_is_at_most_150_lines():
    n = lines_of(ROOT / "README.md")
    assert n <= 150, f"README.md has {n} lines: keep it the front door (details belong in docs/)"


def test_benchmarks_page_is_at_most_450_lines():
    n = lines_of(ROOT / "docs" / "benchmarks.md")
    assert n <= 450, f"docs/benchmarks.md has {n} lines: figures with their commands, not a journal"


# ---------------------------------------------------------------- history

_ORDINALS = ("first second third fourth fifth sixth seventh eighth ninth tenth eleventh twelfth thirteenth "
             "fourteenth fifteenth sixteenth seventeenth eighteenth nineteenth twentieth").split()
_MONTHS = ("january february march april may june july august september october november december "
           "jan feb mar apr jun jul aug sep sept oct nov dec").split()

HISTORY = {
    "a date": re.compile(r"(?<!\d)(?:19|20)\d\d-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])(?!\d)"),
    "a local path": re.compile(r"/work/"),
    "the design notes": re.compile(r"DESIGN\.md"),
    "an issue number": re.compile(r"\bissues?\s*#\s*\d+|\(#\d+\)", re.IGNORECASE),
    "a numbered session": re.compile(
        r"\b(?:" + "|".join(_ORDINALS) + r"|\d+(?:st|nd|rd|th))[ -]session\b", re.IGNORECASE),
    "a dated session": re.compile(
        r"\bsession of (?:the )?(?:" + "|".join(_MONTHS) + r")\b", re.IGNORECASE),
    "a development session": re.compile(
        r"\b(?:(?:in|before|after|since|during|until) (?:this|the last|the previous|an earlier|a later|that)"
        r"|development|working|coding) session\b", re.IGNORECASE),
}


def history_files() -> list[Path]:
    files = list(PAGES)
    if (ROOT / "CHANGELOG.md").exists():
        files.append(ROOT / "CHANGELOG.md")
    files += sorted((ROOT / "kvtier").rglob("*.py"))
    return files


def history_in(text: str) -> list[str]:
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for what, pattern in HISTORY.items():
            for m in pattern.finditer(line):
                found.append(f"line {n}: {what}: {m.group(0)!r}")
    return found


@pytest.mark.parametrize("path", history_files(), ids=rel)
def test_no_development_history(path: Path):
    found = history_in(path.read_text())
    assert not found, (f"{rel(path)} tells history (git keeps it; say what is true now, with the command "
                       "that shows it):\n  " + "\n  ".join(found))


@pytest.mark.parametrize("text", [
    "measured on 2026-12-05 at noon",
    "see /work/main/docs",
    "as DESIGN.md says",
    "fixed in issue #12",
    "read faster (#49)",
    "the twelfth session showed it",
    "in the 14th session",
    "the session of December 5",
    "the session of Dec 5",
    "before this session's changes",
])
def test_history_patterns_catch_what_they_name(text: str):
    assert history_in(text)


@pytest.mark.parametrize("text", [
    "sessions of 8k tokens return",
    "each session's KV",
    "commit 949d798, sha256:2026ab",
    "kvtier bench resume --sessions 3",
    "the next session to return",
    "sessions of 5 turns each",
    "a burst's first sessions start early",
    "upstream (vllm PR #55191)",
])
def test_history_patterns_leave_the_product_alone(text: str):
    assert not history_in(text)


# ---------------------------------------------------------------- links

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.DOTALL)
_INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.MULTILINE)
_HTML_REF = re.compile(r"""<(?:a|img)\b[^>]*?\b(?:href|src)\s*=\s*["']([^"']+)["']""", re.IGNORECASE)
_HTML_ID = re.compile(r"""<[a-z]+\b[^>]*?\b(?:id|name)\s*=\s*["']([^"']+)["']""", re.IGNORECASE)
_HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$", re.MULTILINE)


def without_code(text: str) -> str:
    """The page with fenced blocks and code spans blanked (lines kept), so
    that neither a link nor a heading is read inside code."""
    text = _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return _CODE_SPAN.sub(lambda m: " " * len(m.group(0)), text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text as rendered (links and emphasis
    reduced to their text), lower-cased, every character but letters,
    digits, spaces, '-' and '_' dropped, spaces turned to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text)
    text = text.lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = path.read_text()
    plain = re.sub(_FENCE, lambda m: "\n" * m.group(0).count("\n"), text)
    seen: dict[str, int] = {}
    out = set()
    for m in _HEADING.finditer(plain):
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    out.update(_HTML_ID.findall(plain))
    return out


def targets(path: Path) -> list[tuple[int, str]]:
    text = without_code(path.read_text())
    found = sorted((m.start(), m.group(1)) for p in (_INLINE_LINK, _REF_DEF, _HTML_REF) for m in p.finditer(text))
    return [(text.count("\n", 0, at) + 1, target) for at, target in found]


def broken_links(path: Path) -> list[str]:
    broken = []
    for line, target in targets(path):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"line {line}: {target}: no file {file_part}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"line {line}: {target}: no heading #{anchor} in {rel(dest)}")
    return broken


@pytest.mark.parametrize("path", PAGES, ids=rel)
def test_relative_links_resolve(path: Path):
    broken = broken_links(path)
    assert not broken, f"{rel(path)} has broken links:\n  " + "\n  ".join(broken)


def test_slugs_follow_github():
    assert slug("CPU per GB read, in service") == "cpu-per-gb-read-in-service"
    assert slug("`shm` tier (host DRAM shared by every process of the node)") == \
        "shm-tier-host-dram-shared-by-every-process-of-the-node"
    assert slug("faultfs: a file system that is slow or broken on command") == \
        "faultfs-a-file-system-that-is-slow-or-broken-on-command"
    assert slug("Before a rollout: `kvtier check`") == "before-a-rollout-kvtier-check"
    assert slug("load_decision and [vLLM](vllm.md)") == "load_decision-and-vllm"


def test_links_checker_finds_what_is_broken(tmp_path: Path):
    (tmp_path / "a.md").write_text("# Title\n\n## Same\n\n## Same\n\n```\n# not a heading\n```\n")
    page = tmp_path / "b.md"
    page.write_text(
        "[ok](a.md#title) [dup](a.md#same-1) [self](#here)\n\n# Here\n\n"
        "[gone](missing.md) [no anchor](a.md#nope) [code heading](a.md#not-a-heading)\n"
        "`[in code](missing.md)` [web](https://example.com/x.md)\n"
    )
    broken = broken_links(page)
    assert [b.split(":")[1].strip() for b in broken] == ["missing.md", "a.md#nope", "a.md#not-a-heading"]


# ---------------------------------------------------------------- layout

_LAYOUT_ITEM = re.compile(r"^- `([a-z0-9_/]+/)`: (.*)$", re.MULTILINE)


def layout_mismatches(page: str, package: Path) -> list[str]:
    """How docs/architecture.md's folder list ("Layout: which folder owns
    what") and ``package``'s tree differ: a package folder with modules of
    its own that the list leaves out, a folder it names that is no package,
    a module an item names that is not in its folder (or, written as a
    path from the repository's root, not there)."""
    section = page.partition("## Layout: which folder owns what")[2].partition("\n## ")[0]
    items = {folder: text for folder, text in _LAYOUT_ITEM.findall(section)}
    folders = {f"{p.parent.relative_to(package).as_posix()}/".replace("./", "")
               for p in package.rglob("__init__.py") if any(m.name != "__init__.py" for m in p.parent.glob("*.py"))}
    folders = {f"{package.name}/" if f == "" else f for f in folders}
    found = [f"the list leaves out {f}" for f in sorted(folders - set(items))]
    found += [f"{f} is no package folder" for f in sorted(set(items) - folders)]
    for folder, text in items.items():
        base = package if folder == f"{package.name}/" else package / folder
        for name in re.findall(r"`([\w/.]+\.(?:py|c))`", text):
            where = package.parent / name if "/" in name else base / name
            if not where.exists():
                found.append(f"{folder}: no {name}")
    return found


def test_the_architecture_pages_folder_list_matches_the_tree():
    found = layout_mismatches((ROOT / "docs" / "architecture.md").read_text(), ROOT / "kvtier")
    assert not found, "docs/architecture.md's folder list and kvtier/ differ:\n  " + "\n  ".join(found)


def test_the_folder_list_check_finds_what_differs(tmp_path: Path):
    for f in ("pkg/__init__.py", "pkg/a.py", "pkg/sub/__init__.py", "pkg/sub/b.py", "pkg/new/__init__.py",
              "pkg/new/n.py", "pkg/only/__init__.py", "pkg/only/below/__init__.py", "pkg/only/below/d.py"):
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("")
    page = ("## Layout: which folder owns what\n\n- `pkg/`: `a.py`, `gone.py`\n- `sub/`: `b.py`, `pkg/sub/b.py`\n"
            "- `only/below/`: `d.py`\n- `old/`: `c.py`\n\n## Next\n\n- `new/`: listed outside the section\n")
    assert layout_mismatches(page, tmp_path / "pkg") == [
        "the list leaves out new/", "old/ is no package folder", "pkg/: no gone.py", "old/: no c.py"]
