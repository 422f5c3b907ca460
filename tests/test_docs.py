"""The docs stay short and current: docs/*.md at most 1,200 lines together, docs/training.md at
most 150, no dated section headings (a date goes beside its figure), and every relative link
in the tracked markdown files resolves to a file, and to a heading where it names one."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
DATE = re.compile(r"\b20\d\d-\d\d(-\d\d)?\b")


def markdown_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z", "*.md"], cwd=ROOT, capture_output=True,
                         check=True)
    return [ROOT / p for p in out.stdout.decode().split("\0") if p and (ROOT / p).is_file()]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    lines = path.read_text(encoding="utf-8").splitlines()
    return {slug(line.lstrip("#")) for line in lines if re.match(r"#{1,6} ", line)}


def test_docs_are_short():
    lines = {p.name: len(p.read_text(encoding="utf-8").splitlines())
             for p in (ROOT / "docs").glob("*.md")}
    assert sum(lines.values()) <= 1200, f"docs/*.md: {sum(lines.values())} lines {lines}"
    assert lines["training.md"] <= 150


def test_no_dated_headings():
    dated = [f"{p.relative_to(ROOT)}: {line}" for p in markdown_files()
             for line in p.read_text(encoding="utf-8").splitlines()
             if line.startswith("#") and DATE.search(line)]
    assert not dated, "\n".join(dated)


def test_relative_links_resolve():
    broken = []
    for page in markdown_files():
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
