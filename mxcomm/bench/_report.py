"""What every benchmark result carries (device, world size, shapes, date, commit, versions) and how
results are written: text tables (tabulate), ``--json`` and ``--markdown`` files.

A result is ``(meta, tables)``: ``meta`` from :func:`metadata`, ``tables`` a dict of table name to
rows (lists of dicts, every number as measured). Formatting never changes the stored numbers.
"""

import datetime
import importlib.metadata
import json
import math
import os
import platform
import subprocess
import sys
import textwrap

#: The fields :func:`metadata` always fills.
META_FIELDS = ("benchmark", "device", "backend", "world_size", "shapes", "date", "commit",
               "versions", "notes")


def git_commit(cwd=None):
    """``$MXCOMM_COMMIT`` if set (a copied tree whose ``.git`` is stale), else the checkout's
    ``git rev-parse --short HEAD``, else ``"unknown"``."""
    if os.environ.get("MXCOMM_COMMIT"):
        return os.environ["MXCOMM_COMMIT"]
    if cwd is None:
        cwd = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=cwd, capture_output=True,
                             text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def cpu_name():
    """The CPU's model name and core count, e.g. ``"CPU Intel(R) Xeon(R) Processor, 2 cores"``."""
    model = platform.processor() or platform.machine() or "unknown model"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"CPU {model}, {os.cpu_count()} cores"


def device_name():
    """The current GPU's name (torch, else CuPy), or :func:`cpu_name` without a GPU."""
    from mxcomm import _platform
    if not _platform.gpu_arrays():
        return cpu_name()
    try:
        import torch
        if torch.cuda.is_available():
            return torch.cuda.get_device_name()
    except ImportError:
        pass
    import cupy
    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def _dist_version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def library_versions():
    """Versions of what the numbers depend on; ``None`` for what is not installed."""
    versions = {"python": platform.python_version(), "numpy": _dist_version("numpy"),
                "numba": _dist_version("numba"), "numba-cuda": _dist_version("numba-cuda"),
                "mpi4py": _dist_version("mpi4py"), "torch": None, "cupy": None,
                "nccl (cupy)": None, "nccl (torch)": None, "cuda (torch)": None}
    try:
        import torch
        versions["torch"] = torch.__version__
        versions["cuda (torch)"] = torch.version.cuda
        if torch.cuda.is_available():
            versions["nccl (torch)"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # noqa: BLE001  (a broken optional install must not stop the report)
        pass
    from mxcomm import _platform
    if _platform.gpu_arrays():
        try:
            import cupy
            versions["cupy"] = cupy.__version__
            from cupy.cuda import nccl
            v = nccl.get_version()
            versions["nccl (cupy)"] = f"{v // 10000}.{v // 100 % 100}.{v % 100}"
        except Exception:  # noqa: BLE001
            pass
    if "mpi4py.MPI" in sys.modules:  # launched by mpirun (torchrun runs without MPI)
        try:
            from mpi4py import MPI
            versions["mpi"] = MPI.Get_library_version().splitlines()[0].strip()
        except Exception:  # noqa: BLE001
            pass
    return versions


def metadata(benchmark, world_size, shapes, notes=(), **extra):
    """Metadata of one benchmark run.

    Args:
        benchmark: ``"kernels"``, ``"a2a"`` or ``"pipeline"``.
        world_size: W.
        shapes: JSON-able description of the shapes measured.
        notes: lines stating how the numbers were taken.
        extra: more JSON-able fields (iterations, options).
    Returns:
        A dict with every field of :data:`META_FIELDS` plus ``extra``.
    """
    from mxcomm import _platform
    meta = {"benchmark": benchmark, "device": device_name(),
            "backend": _platform.describe(), "world_size": int(world_size),
            "shapes": shapes,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit(), "versions": library_versions(), "notes": list(notes)}
    meta.update(extra)
    return meta


def _cell(value, digits=3):
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        if math.isinf(value):
            return "inf"
        return f"{value:.{digits}f}"
    return value


def format_table(rows, columns=None, fmt="grid", digits=3):
    """Rows (dicts) as a text table; floats rounded to ``digits`` places for display only.

    Args:
        rows: list of dicts.
        columns: the keys to show, in order (default: the first row's keys).
        fmt: a tabulate format (``"grid"`` for text, ``"github"`` for Markdown).
    """
    from tabulate import tabulate
    if not rows:
        return "(no rows)"
    columns = list(columns or rows[0].keys())
    body = [[_cell(r.get(c, ""), digits) for c in columns] for r in rows]
    return tabulate(body, headers=columns, tablefmt=fmt, disable_numparse=True)


def header_lines(meta):
    """The human-readable metadata header shared by the text and Markdown outputs."""
    v = meta["versions"]
    libs = ", ".join(f"{k} {v[k]}" for k in ("torch", "cupy", "numba-cuda", "nccl (cupy)",
                                             "nccl (torch)") if v.get(k))
    lines = [f"device: {meta['device']}", f"backend: {meta.get('backend', '')}",
             f"world size: {meta['world_size']}",
             f"date: {meta['date']}", f"commit: {meta['commit']}", f"libraries: {libs}"]
    return lines + [f"note: {n}" for n in meta["notes"]]


#: Columns of the printed report: header lines and captions wrap there, tables are made to fit.
WIDTH = 120


def render_text(title, meta, sections):
    """The printed report: a title, the metadata header, then each ``(caption, table_text)``;
    header lines and captions wrapped at :data:`WIDTH` columns."""
    bar = "=" * WIDTH
    out = [bar, title]
    for line in header_lines(meta):
        out += textwrap.wrap(line, WIDTH, subsequent_indent="      ", break_on_hyphens=False)
    out.append(bar)
    for caption, text in sections:
        out += ["", *textwrap.wrap(caption, WIDTH, break_on_hyphens=False), text]
    return "\n".join(out)


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # NumPy scalars
        return _jsonable(value.item())
    return value


def write_json(path, meta, tables):
    """Write ``{"meta": meta, "tables": tables}`` (strict JSON: NaN → null, inf → "inf")."""
    with open(path, "w") as f:
        json.dump(_jsonable({"meta": meta, "tables": tables}), f, indent=2)
        f.write("\n")


def write_markdown(path, title, meta, sections):
    """Write a short Markdown report: the metadata header and each ``(caption, rows, columns)``."""
    lines = [f"# {title}", ""] + ([meta["run"], ""] if meta.get("run") else [])
    lines += [f"- {line}" for line in header_lines(meta)]
    for caption, rows, columns in sections:
        lines += ["", f"## {caption}", "", format_table(rows, columns, fmt="github")]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def speedup(x):
    """``1.50x``-style display of a ratio (``n/a`` for NaN)."""
    return "n/a" if not math.isfinite(x) else f"{x:.2f}x"
