"""The notebooks in notebooks/ run top to bottom without an error (in a fresh Jupyter kernel of
this interpreter, cwd notebooks/, as a person would run them), and are committed with their
outputs cleared.

Every notebook runs with JETSPEC_NOTEBOOK_TINY=1 (02_one_round then uses a tiny random model,
01_quickstart decodes fewer tokens of SmolLM2, 03_train_head trains fewer steps), and
02_one_round once more on SmolLM2 as a person would run it. 03_train_head writes under a
temporary directory (JETSPEC_NOTEBOOK_WORKDIR); 04_benchmarks is also handed a
`jetspec bench --out`-shaped file (JETSPEC_BENCH_DIRS) so its tau/speedup plot runs too.
"""

import json
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
EXPECTED = {"01_quickstart.ipynb", "02_one_round.ipynb", "03_train_head.ipynb",
            "04_benchmarks.ipynb"}
CELL_TIMEOUT_S = 300
SLOW = pytest.mark.slow  # runs that load the real SmolLM2 weights (as in test_convert)
SMOLLM2_EVEN_TINY = "01_quickstart.ipynb"  # its tiny mode runs SmolLM2 too
# (notebook, tiny mode): every notebook in tiny mode, and the one that has a tiny mode without it.
RUNS = [pytest.param(p, True, id=p.stem, marks=[SLOW] if p.name == SMOLLM2_EVEN_TINY else [])
        for p in NOTEBOOKS] + [
    pytest.param(p, False, id=f"{p.stem}-smollm2", marks=[SLOW]) for p in NOTEBOOKS
    if p.name == "02_one_round.ipynb"]


def test_expected_notebooks_exist():
    """Guards the parametrised tests below against an empty (silently skipped) glob."""
    assert EXPECTED <= {p.name for p in NOTEBOOKS}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, f"{path.name} has no code cells"
    dirty = [i for i, c in enumerate(nb.cells)
             if c.cell_type == "code" and (c.outputs or c.execution_count is not None)]
    assert not dirty, (f"{path.name}: cells {dirty} hold outputs or execution counts; clear "
                       "them before committing (Jupyter: Edit > Clear All Outputs)")
    assert 'find_spec("jetspec_jax")' in code[0].source, (
        f"{path.name}: the first code cell must be the set-up cell that installs the package")
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3"


def test_quickstart_asks_the_cli_builtin_prompt():
    """01_quickstart's tiny run and `jetspec generate --max-new-tokens 8` share one compiled
    program only while their prompts are the same (tests/test_api_cli.py)."""
    from jetspec_jax.cli import BUILTIN_PROMPT

    nb = nbformat.read(NOTEBOOK_DIR / "01_quickstart.ipynb", as_version=4)
    cell = next(c.source for c in nb.cells if c.source.startswith("PROMPT = "))
    scope = {}
    exec(cell.split("\nMAX_NEW")[0], scope)  # the PROMPT assignment alone
    assert scope["PROMPT"] == BUILTIN_PROMPT


def write_bench_sweep(directory: Path) -> None:
    """A file shaped as `jetspec bench --out` writes it (`cli.run_bench`), made-up numbers."""
    rows = [dict(budget=b, tau=1.0 + 0.4 * i, tau_hist=[0, 1], tokens=64, seconds=1.0,
                 tokens_per_s=20.0 + 3 * i, ar_seconds=1.0, ar_tokens_per_s=20.0,
                 speedup=1.0 + 0.15 * i, identical=True, compile_s=5.0)
            for i, b in enumerate((4, 8, 16, 32))]
    info = dict(model="tiny-test", draft="made-up head", prompts=["p"], max_new_tokens=64,
                tree="accum_logp", width=7, attn_impl="reference", dtype="float32",
                backend="cpu", rows=rows)
    (directory / "bench_sweep_test.json").write_text(json.dumps(info, indent=1))


@pytest.mark.parametrize("path,tiny", RUNS)
def test_notebook_runs(path, tiny, tmp_path, monkeypatch, request):
    if not tiny or path.name == SMOLLM2_EVEN_TINY:  # SmolLM2 from the run's converted copy
        request.getfixturevalue("use_smollm2_cache")
    if tiny:
        monkeypatch.setenv("JETSPEC_NOTEBOOK_TINY", "1")
    else:
        monkeypatch.delenv("JETSPEC_NOTEBOOK_TINY", raising=False)
    monkeypatch.setenv("JETSPEC_NOTEBOOK_WORKDIR", str(tmp_path / "work"))
    sweeps = tmp_path / "bench"
    sweeps.mkdir()
    write_bench_sweep(sweeps)
    monkeypatch.setenv("JETSPEC_BENCH_DIRS", str(sweeps))
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend draws figures
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    start = time.perf_counter()
    client.execute()  # raises CellExecutionError (with the cell's traceback) on any error
    seconds = time.perf_counter() - start
    code = [c for c in nb.cells if c.cell_type == "code"]
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    assert all(c.execution_count is not None for c in code)
    # Every cell that shows a figure showed one (no plot quietly left out by a branch).
    for i, c in enumerate(code):
        if "plt.show()" in c.source:
            assert any("image/png" in o.get("data", {}) for o in c.outputs), (
                f"{path.name}: code cell {i} drew no figure")
    print(f"{path.name}: {seconds:.1f} s")
