"""Recipes: the formats of a whole EP token path by name, and the ``"auto"`` choice among them.

A :class:`Recipe` maps onto the primitives' keywords one to one (docs/design.md, "Recipes and
the expert-parallel object")::

    exchange_layout(counts, comm)                                   -> layout
    fused:      a2a_dispatch(x, layout, precision=dispatch, grad_precision=dispatch_grad,
                             permute_align=A)                       -> rows, indices, offsets
                a2a_combine(y, layout, precision=combine, grad_precision=combine_grad,
                            permute_align=A)
    not fused:  a2a_dispatch(x, layout, precision=dispatch, grad_precision=dispatch_grad)
                permute(received, layout, align=A, out_format=permute_format)
                unpermute(y, indices, layout, grad_format=unpermute_grad_format)
                a2a_combine(unpermuted, layout, precision=combine, grad_precision=combine_grad)

``"auto"``: per layout, :func:`choose_recipe` picks what a :class:`CostTable` predicts fastest.
No torch import here.
"""

import bisect
import dataclasses
import hashlib
import json
import math
import os
import pathlib
import re
import warnings

#: The fp8 GEMM products (``mxcomm.torch.grouped_mm``'s ``fast_accum`` names).
GEMMS = ("forward", "dgrad", "wgrad")
#: The name that asks for a recipe chosen per layout.
AUTO = "auto"
#: Device classes the choice tells apart, least capable first (the ranks agree on the minimum).
DEVICE_CLASSES = ("cpu", "cuda", "sm90")


@dataclasses.dataclass(frozen=True)
class Recipe:
    """The formats of one EP token path (module docstring's mapping onto the primitives).

    Attributes:
        dispatch, combine, dispatch_grad, combine_grad: ``mxcomm.formats`` names per direction.
        dispatch_grad_across_nodes: None, or dispatch_grad's format where the group spans
            several nodes (:meth:`for_nodes`).
        gemm: ``"bf16"`` or ``"fp8"`` (fp8 rowwise rows: ``grouped_mm``'s SM90 path).
        fused: the exchanges' expert side in permute's order: no separate (un)permute pass.
        permute_format: None, or what the separate permute converts received rows to.
        unpermute_grad_format: None, or what unpermute's backward converts its gradient to.
        wgrad, fast_accum: ``grouped_mm``'s arguments of the same names.
    """

    name: str
    dispatch: str
    combine: str
    dispatch_grad: str
    combine_grad: str
    gemm: str = "bf16"
    fused: bool = False
    permute_format: object = None
    unpermute_grad_format: object = None
    wgrad: str = "fp8"
    fast_accum: tuple = GEMMS
    dispatch_grad_across_nodes: object = None

    def for_nodes(self, nodes):
        """The recipe as a group spanning ``nodes`` nodes (``comm.node_count``) runs it:
        ``dispatch_grad_across_nodes`` in place of ``dispatch_grad`` where set and ``nodes`` >
        1, else itself (docs/design.md, "The dispatch gradient follows the topology")."""
        across = self.dispatch_grad_across_nodes
        if nodes > 1 and across is not None and across != self.dispatch_grad:
            return dataclasses.replace(self, dispatch_grad=across)
        return self

    def describe(self):
        """One line: the four directions, the layout of the expert side, the GEMM."""
        side = "fused (permute_align)" if self.fused else "permuted separately"
        gemm = f"fp8 rowwise GEMM ({self.wgrad} wgrad)" if self.gemm == "fp8" else "bf16 GEMM"
        across = self.dispatch_grad_across_nodes
        nodes = f" ({across} across nodes)" if across not in (None, self.dispatch_grad) else ""
        return (f"{self.name}: dispatch {self.dispatch}, combine {self.combine}, dispatch_grad "
                f"{self.dispatch_grad}{nodes}, combine_grad {self.combine_grad}, {side}, {gemm}")


_RECIPES = (
    Recipe("bf16", "bf16", "bf16", "bf16", "bf16"),
    Recipe("mxfp8", "mxfp8", "bf16", "bf16", "mxfp8", permute_format="bf16",
           unpermute_grad_format="bf16"),
    # dispatch_grad bf16 on one node: beside the wgrad (the backward overlap) copy engines only,
    # no quantize on SMs; MXFP8 across nodes, where bytes bound the step (docs/design.md, "Why
    # the fp8 recipe's dispatch gradient travels in bf16")
    Recipe("fp8_rowwise", "fp8_rowwise", "bf16", "bf16", "fp8_rowwise", gemm="fp8",
           fused=True, dispatch_grad_across_nodes="mxfp8"),
    # combine_grad and wgrad in bf16 for torchtitan's weight gradients (bench/NOTES.md, "The
    # expert weight gradients"); not in the cost table, so "auto" never picks it
    Recipe("fp8_rowwise_gradbf16", "fp8_rowwise", "bf16", "bf16", "bf16", gemm="fp8",
           fused=True, wgrad="bf16"),
)
_BY_NAME = {r.name: r for r in _RECIPES}


def recipe_names():
    """Every name :func:`get_recipe` and ``ExpertParallel(recipe=...)`` take, ``"auto"`` first."""
    return (AUTO,) + tuple(_BY_NAME)


def get_recipe(name):
    """The :class:`Recipe` named ``name`` (not ``"auto"``); ValueError listing the recipes for an
    unknown name."""
    recipe = _BY_NAME.get(name)
    if recipe is None:
        raise ValueError(f"recipe: unknown recipe {name!r}; expected one of "
                         f"{', '.join(recipe_names())}")
    return recipe


def runnable(recipe, device):
    """Whether devices of class ``device`` run ``recipe`` as named (an fp8 GEMM needs
    ``"sm90"``; elsewhere ``grouped_mm`` falls back to bf16)."""
    return recipe.gemm != "fp8" or device == "sm90"


@dataclasses.dataclass(frozen=True)
class CostTable:
    """Measured fwd + bwd times (ms) of the whole EP layer per recipe at one shape (D, H).

    Attributes:
        rows: two or more ascending rows per rank. ms: recipe -> times, one per row, bf16 among
            them. ref_dim, ref_hidden: the (D, H) measured. device: ``torch.cuda.
            get_device_name`` or ``"cpu"``; ``""``: hand-made, never checked. world_size,
            experts_per_rank: 0 when not recorded.
    """

    rows: tuple
    ms: dict
    ref_dim: int
    ref_hidden: int
    source: str = ""
    device: str = ""
    world_size: int = 0
    experts_per_rank: int = 0

    def predict(self, name, rows, dim, hidden):
        """Predicted ms of recipe ``name`` at ``rows`` rows per rank, D ``dim``, H ``hidden``:
        rows scaled by D H / (ref_dim ref_hidden), interpolated linearly (flat below the first
        point, the last segment extended above)."""
        x = rows * dim * hidden / (self.ref_dim * self.ref_hidden)
        points, ms = self.rows, self.ms[name]
        i = bisect.bisect_right(points, x)
        if i == 0:
            return ms[0]
        i = min(i, len(points) - 1)
        x0, x1 = points[i - 1], points[i]
        return ms[i - 1] + (ms[i] - ms[i - 1]) * (x - x0) / (x1 - x0)

    def to_dict(self):
        """The table as the JSON object :func:`save_table` writes (:func:`table_from_dict`)."""
        return {"format": TABLE_FORMAT, "version": TABLE_VERSION, "device": self.device,
                "world_size": self.world_size, "dim": self.ref_dim, "hidden": self.ref_hidden,
                "experts_per_rank": self.experts_per_rank, "rows": list(self.rows),
                "ms": {k: list(v) for k, v in self.ms.items()}, "source": self.source}

    def fingerprint(self):
        """A 63-bit integer of the table's content (ranks compare them to agree)."""
        return _digest([self.to_dict()])


#: The ``format`` and ``version`` fields of a cost table file.
TABLE_FORMAT, TABLE_VERSION = "mxcomm-cost-table", 1
#: Names a cost table file for ``"auto"`` (:func:`find_tables`).
TABLE_ENV = "MXCOMM_COST_TABLE"
#: Names the per-user cache folder (:func:`cache_dir`).
CACHE_ENV = "MXCOMM_CACHE_DIR"


def _digest(objects):
    text = json.dumps(objects, sort_keys=True, separators=(",", ":"))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1


def table_from_dict(obj, where="cost table"):
    """The :class:`CostTable` of a JSON object :meth:`CostTable.to_dict` wrote; ValueError
    naming ``where`` and the field for a field missing, of the wrong type or value."""
    def bad(field, expected, got):
        return ValueError(f"{where}: {field}: expected {expected}, got {got!r}")
    if not isinstance(obj, dict):
        raise bad("the file", "a JSON object", type(obj).__name__)
    if obj.get("format") != TABLE_FORMAT or obj.get("version") != TABLE_VERSION:
        raise bad("format/version", f"{TABLE_FORMAT!r}/{TABLE_VERSION}",
                  f"{obj.get('format')}/{obj.get('version')}")
    for field in ("world_size", "dim", "hidden", "experts_per_rank"):
        value = obj.get(field)
        if type(value) is not int or value < 1:
            raise bad(field, "a positive integer", value)
    if not isinstance(obj.get("device"), str) or not obj["device"]:
        raise bad("device", "a device name", obj.get("device"))
    rows = obj.get("rows")
    if not isinstance(rows, list) or len(rows) < 2 or \
            any(type(r) is not int or r < 1 for r in rows) or sorted(set(rows)) != rows:
        raise bad("rows", "two or more ascending positive integers", rows)
    ms = obj.get("ms")
    if not isinstance(ms, dict) or "bf16" not in ms:
        raise bad("ms", "an object of times per recipe, bf16 among them", ms)
    for name, times in ms.items():
        if name not in _BY_NAME:
            raise bad(f"ms: {name!r}", f"a recipe ({', '.join(_BY_NAME)})", name)
        if not isinstance(times, list) or len(times) != len(rows) or any(
                type(t) not in (int, float) or not math.isfinite(t) or t <= 0 for t in times):
            raise bad(f"ms: {name}", f"{len(rows)} positive times (ms), one per row", times)
    return CostTable(rows=tuple(rows), ms={k: tuple(float(t) for t in v) for k, v in ms.items()},
                     ref_dim=obj["dim"], ref_hidden=obj["hidden"],
                     source=str(obj.get("source", "")), device=obj["device"],
                     world_size=obj["world_size"], experts_per_rank=obj["experts_per_rank"])


def load_table(path):
    """The :class:`CostTable` in the JSON file ``path``; ValueError naming the path where it is
    unreadable, not JSON, or not a cost table."""
    where = f"cost table {os.fspath(path)}"
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}: cannot read it as JSON: {e}") from None
    return table_from_dict(obj, where)


def save_table(table, path):
    """Write ``table`` as JSON to ``path`` (folders made, replaced atomically); return it."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(table.to_dict(), indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def cache_dir(environ=None):
    """The per-user folder of calibrated tables: ``$MXCOMM_CACHE_DIR/cost_tables``, else
    ``$XDG_CACHE_HOME/mxcomm/cost_tables``, else ``~/.cache/mxcomm/cost_tables``."""
    environ = os.environ if environ is None else environ
    root = environ.get(CACHE_ENV) or os.path.join(
        environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "mxcomm")
    return pathlib.Path(root) / "cost_tables"


def _slug(device):
    return re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")


def cache_path(device, world_size, dim, hidden, environ=None):
    """``cache_dir() / <device>_w<W>_d<D>_h<H>.json``: where ``calibrate`` saves and ``"auto"``
    finds a table (the device name lower-cased, other characters as ``-``)."""
    return cache_dir(environ) / f"{_slug(device)}_w{world_size}_d{dim}_h{hidden}.json"


class TableSet:
    """The cost tables ``"auto"`` reads for one group (:func:`find_tables`): ``pinned`` (a
    :class:`CostTable` for every shape, or None), ``cached`` (``{(dim, hidden): CostTable}``),
    ``origin`` (where ``pinned`` came from, or the cache folder)."""

    def __init__(self, pinned=None, cached=None, origin="built-in", built_in=None):
        self.pinned, self.cached, self.origin = pinned, dict(cached or {}), origin
        #: The built-in table for shapes nothing else covers (:func:`built_in_table`).
        self.built_in = H100_TABLE if built_in is None else built_in

    def table_for(self, dim, hidden):
        """The pinned table; else the cached one of (``dim``, ``hidden``) (``hidden`` None: the
        only one of width ``dim``); else :attr:`built_in`."""
        if self.pinned is not None:
            return self.pinned
        if hidden is not None:
            return self.cached.get((dim, int(hidden)), self.built_in)
        widths = [t for (d, _), t in self.cached.items() if d == dim]
        return widths[0] if len(widths) == 1 else self.built_in

    def fingerprint(self):
        """A 63-bit integer of every table read (ranks compare them to agree)."""
        if self.pinned is not None:
            return _digest([self.pinned.to_dict()])
        return _digest([None] + [self.cached[k].to_dict() for k in sorted(self.cached)] +
                       [self.built_in.to_dict()])


def _check_describes(table, device, world_size, where):
    if table.device and table.device != device:
        raise ValueError(f"{where}: measured on {table.device!r}, this rank runs {device!r}; "
                         f"calibrate on these devices (python -m mxcomm.bench calibrate)")
    if table.world_size and table.world_size != world_size:
        raise ValueError(f"{where}: measured at {table.world_size} ranks, the group has "
                         f"{world_size}; calibrate at this world size")


def find_tables(device, world_size, table=None, environ=None):
    """The tables ``"auto"`` reads on this rank, in lookup order (docs/design.md):

    1. ``table``: a :class:`CostTable` or the path of a table file, for every shape;
    2. else the file named by ``$MXCOMM_COST_TABLE``, for every shape;
    3. else the per-user cache (:func:`cache_path`): the tables of ``device`` and
       ``world_size``, each for its own dims;
    4. for shapes none of these covers, the built-in table of ``device`` and ``world_size``
       (:func:`built_in_table`), :data:`H100_TABLE` for a device with none.

    ``device``: ``torch.cuda.get_device_name`` or ``"cpu"``; ``environ``: default
    ``os.environ``. Returns a :class:`TableSet`. Raises ValueError for ``table`` not a CostTable
    or path, or a table of 1. or 2. unreadable, malformed, or of another device or world size;
    warns (RuntimeWarning) and skips a cached table so.
    """
    environ = os.environ if environ is None else environ
    named = ""
    if table is None and environ.get(TABLE_ENV):
        table, named = environ[TABLE_ENV], f" (named by ${TABLE_ENV})"
    if table is not None:
        where = "table"
        if not isinstance(table, CostTable):
            if not isinstance(table, (str, os.PathLike)):
                raise ValueError(f"table: expected a CostTable or a path, got "
                                 f"{type(table).__name__}")
            where = f"cost table {os.fspath(table)}{named}"
            try:
                table = load_table(table)
            except ValueError as e:
                raise ValueError(f"{e}{named}") from None
        _check_describes(table, device, world_size, where)
        return TableSet(pinned=table, origin=where,
                        built_in=built_in_table(device, world_size))
    folder = cache_dir(environ)
    cached = {}
    for path in sorted(folder.glob(f"{_slug(device)}_w{world_size}_d*_h*.json")):
        try:
            found = load_table(path)
            _check_describes(found, device, world_size, f"cost table {path}")
        except ValueError as e:
            warnings.warn(f"mxcomm auto: skipping a cached table: {e}", RuntimeWarning,
                          stacklevel=2)
            continue
        cached[(found.ref_dim, found.ref_hidden)] = found
    return TableSet(cached=cached, origin=str(folder),
                    built_in=built_in_table(device, world_size))


#: The built-in table of H100s, and of devices with none of their own:
#: bench/results/2026-11-27/pipeline_recipes_194096a_uniform_w2_h100.json
#: (``python -m mxcomm.bench pipeline --interleave``; bf16 is the variant bf16_mxcomm).
H100_TABLE = CostTable(
    rows=(4096, 16384, 32768, 65536, 131072),
    ms={"bf16": (3.483, 4.494, 8.019, 14.779, 29.390),
        "mxfp8": (3.626, 4.693, 7.773, 14.114, 27.495),
        "fp8_rowwise": (6.959, 6.632, 8.583, 12.108, 20.523)},
    ref_dim=7168, ref_hidden=2048,
    source="2 x H100 at 194096a (2026-11-27), dim 7168, hidden 2048, 8 experts per rank, "
           "uniform routing", device="NVIDIA H100 80GB HBM3", world_size=2, experts_per_rank=8)
#: The built-in table of H200s: bench/results/2026-11-28/calibrate_21726bb_w2_h200.json
#: (``python -m mxcomm.bench calibrate``; the recipes of :data:`H100_TABLE`).
H200_TABLE = CostTable(
    rows=(4096, 16384, 32768, 65536, 131072),
    ms={"bf16": (2.946, 3.995, 7.163, 13.852, 27.419),
        "mxfp8": (3.198, 4.167, 6.870, 12.983, 25.594),
        "fp8_rowwise": (4.626, 4.321, 5.274, 9.100, 16.588)},
    ref_dim=7168, ref_hidden=2048,
    source="2 x H200 at 21726bb (2026-11-28), dim 7168, hidden 2048, 8 experts per rank, "
           "uniform routing", device="NVIDIA H200", world_size=2, experts_per_rank=8)
#: The built-in table of 4 or more H200s: bench/results/2026-11-28/calibrate_cd34cd7_w4_h200.json.
H200_W4_TABLE = CostTable(
    rows=(4096, 8192, 16384, 32768, 65536, 131072),
    ms={"bf16": (2.746, 3.221, 4.449, 8.066, 15.518, 30.473),
        "mxfp8": (2.936, 3.381, 4.479, 7.574, 14.112, 27.734),
        "fp8_rowwise": (3.849, 4.072, 4.927, 5.986, 9.746, 17.928)},
    ref_dim=7168, ref_hidden=2048,
    source="4 x H200 at cd34cd7 (2026-11-28), dim 7168, hidden 2048, 8 experts per rank, "
           "uniform routing", device="NVIDIA H200", world_size=4, experts_per_rank=8)
#: The built-in tables by device name (``torch.cuda.get_device_name``), one per world size
#: measured (:func:`built_in_table`); other devices get :data:`H100_TABLE`.
BUILT_IN = {"NVIDIA H100 80GB HBM3": (H100_TABLE,), "NVIDIA H200": (H200_TABLE, H200_W4_TABLE)}


def built_in_table(device, world_size):
    """The built-in table of ``device`` measured at the largest world size not above
    ``world_size`` (else its smallest); :data:`H100_TABLE` for a device without one."""
    tables = sorted(BUILT_IN.get(device, (H100_TABLE,)), key=lambda t: t.world_size)
    fitting = [t for t in tables if t.world_size <= world_size]
    return fitting[-1] if fitting else tables[0]


def rows_per_rank(layout):
    """The most rows any rank sends in ``layout``: a cost table's rows per rank."""
    return max(map(sum, layout.sent))


class Chooser:
    """``"auto"``'s answer for one shape and device class (arguments as :func:`choose_recipe`).

    Predictions are piecewise linear, so the answer changes only at a point or a crossing,
    found once: ``bounds`` (ascending, in the table's scaled rows) and ``answers`` (the
    :class:`Recipe` of each of the ``len(bounds) + 1`` intervals); a choice compares with them.
    """

    def __init__(self, dim, hidden, *, device="cpu", table=H100_TABLE, margin=0.02):
        if device not in DEVICE_CLASSES:
            raise ValueError(f"choose_recipe: device: expected one of {DEVICE_CLASSES}, got "
                             f"{device!r}")
        self._scale = dim * hidden / (table.ref_dim * table.ref_hidden)
        self.table, self.device = table, device
        if device == "cpu" and table.device != "cpu":  # the host backend, not described
            self.bounds, self.answers = [], [_BY_NAME["bf16"]]
            return
        names = [r.name for r in _RECIPES if runnable(r, device) and r.name in table.ms]
        factor = {name: (1.0 - margin if name == "bf16" else 1.0) for name in names}

        def cost(name, x):  # in the table's rows (scaled), margin applied to bf16
            return factor[name] * table.predict(name, x, table.ref_dim, table.ref_hidden)

        points = list(table.rows)
        cuts = set(points)
        # flat below the first point; above the last, a far edge finds crossings of the lines
        edges = points + [1e6 * points[-1] + 1.0]
        for lo, hi in zip(edges, edges[1:]):
            for i, a in enumerate(names):
                for b in names[i + 1:]:
                    d0, d1 = cost(a, lo) - cost(b, lo), cost(a, hi) - cost(b, hi)
                    if d0 * d1 < 0:
                        cuts.add(lo + (hi - lo) * d0 / (d0 - d1))
        cuts = sorted(cuts)
        probes = [cuts[0] - 1.0] + [(u + v) / 2 for u, v in zip(cuts, cuts[1:])] + \
            [cuts[-1] + 1.0]
        answers = [self._best(names, cost, x) for x in probes]
        self.bounds, self.answers = [], [answers[0]]
        for cut, answer in zip(cuts, answers[1:]):
            if answer is not self.answers[-1]:
                self.bounds.append(cut)
                self.answers.append(answer)

    @staticmethod
    def _best(names, cost, x):
        best = min(names, key=lambda name: (cost(name, x), names.index(name)))
        return _BY_NAME[best]

    def __call__(self, layout):
        """The recipe for ``layout`` (its agreed ``sent`` table; no host sync)."""
        return self.for_rows(rows_per_rank(layout))

    def for_rows(self, rows):
        """The recipe for ``rows`` rows per rank (an int, or a traced size: plain comparisons
        ``torch.compile`` folds)."""
        x = rows * self._scale
        answer = self.answers[0]
        for bound, after in zip(self.bounds, self.answers[1:]):
            if x >= bound:
                answer = after
        return answer


def choose_recipe(layout, dim, hidden, *, device="cpu", table=H100_TABLE, margin=0.02):
    """The recipe ``"auto"`` runs for ``layout``: the one predicted fastest.

    Among the recipes the devices run (:func:`runnable`) and ``table`` (a :class:`CostTable`)
    measured, one other than ``"bf16"`` wins only when predicted ``margin`` (a fraction)
    faster; ties keep the earlier. On ``"cpu"``: ``"bf16"`` unless ``table.device == "cpu"``.
    Deterministic, so every rank chooses alike; no host sync, no communication.

    Args:
        layout: from ``mxcomm.exchange_layout``; its ``sent`` table is read.
        dim, hidden: D (token rows' width) and H (the expert GEMM's output width).
        device: the agreed device class (:data:`DEVICE_CLASSES`); ValueError otherwise.
    Returns:
        A :class:`Recipe`.
    """
    return Chooser(dim, hidden, device=device, table=table, margin=margin)(layout)
