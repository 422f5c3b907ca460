"""What the plot scripts share: the headless matplotlib backend, the `FILES --labels --out`
command line, and a PNG written whole or not at all."""

import argparse

import matplotlib
matplotlib.use("Agg")  # headless: bench machines have no display
import matplotlib.pyplot as plt  # noqa: E402

from bench.common.results_io import write_atomic  # noqa: E402

__all__ = ["plt", "files_labels_out", "save_png"]


def files_labels_out(doc: str, files: str = "files", extra=None) -> argparse.Namespace:
    """Parses `FILES... [--labels L...] --out PNG`; labels default to the file names.
    extra(parser), when given, adds the script's own options."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument(files, nargs="+")
    if extra is not None:
        extra(ap)
    ap.add_argument("--labels", nargs="+", help="one per file (default: the file names)")
    ap.add_argument("--out", required=True, help="the PNG to write")
    args = ap.parse_args()
    args.labels = args.labels or getattr(args, files)
    if len(args.labels) != len(getattr(args, files)):
        ap.error("give one --labels entry per file")
    return args


def save_png(fig, out: str, dpi: int = 110) -> None:
    fig.tight_layout()
    write_atomic(out, lambda f: fig.savefig(f, dpi=dpi, format="png"))
    print(f"wrote {out}")
