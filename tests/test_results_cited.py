"""bench/results holds one current file per question: at most MAX_RESULTS files, each named
(by its path under bench/results/) in a doc a user reads: docs/*.md, README.md, bench/README.md
or a shipped head's model card. A rerun replaces a file; git history keeps the older ones."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
MAX_RESULTS = 40


def results() -> list[str]:
    return sorted(p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*") if p.is_file())


def docs_text() -> str:
    docs = [*(ROOT / "docs").glob("*.md"), ROOT / "README.md", ROOT / "bench" / "README.md",
            *(ROOT / "checkpoints").glob("*/README.md")]
    return "\n".join(p.read_text(encoding="utf-8") for p in docs)


def test_at_most_forty_result_files():
    found = results()
    assert found, "bench/results/ is empty: the glob found nothing"
    assert len(found) <= MAX_RESULTS, (
        f"{len(found)} files under bench/results/ (at most {MAX_RESULTS}): keep one current "
        "result per question and delete the superseded ones (git keeps them)")


def test_every_result_file_is_cited_by_a_doc():
    text = docs_text()
    uncited = [f for f in results() if f not in text]
    assert not uncited, ("result files named by no doc (docs/*.md, README.md, bench/README.md, "
                         "a model card): cite each where its figure is given, or delete it:\n"
                         + "\n".join(uncited))
