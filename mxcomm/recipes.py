"""Recipes: the formats of a whole EP token path by name, and the ``"auto"`` choice among them.

A :class:`Recipe` names the wire format of each of the four exchange directions (dispatch,
combine, dispatch_grad, combine_grad), what the expert GEMM reads (``gemm``), and how the
expert side is laid out (``fused``: the exchanges' expert side in permute's order). It maps onto
the array and torch primitives' per-direction keywords one to one (docs/design.md, "Recipes and
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

``"auto"`` is no recipe of its own: per layout, :func:`choose_recipe` returns the recipe a small
cost model (:class:`CostTable`) predicts fastest among those the devices run, from inputs agreed
across ranks. No torch import here.
"""

import bisect
import dataclasses

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
        name: the name :func:`get_recipe` takes.
        dispatch, combine, dispatch_grad, combine_grad: wire formats of the four exchange
            directions (``mxcomm.formats`` names, or ``"bf16"``).
        gemm: ``"bf16"`` (the expert GEMM reads bf16 rows) or ``"fp8"`` (it reads fp8 rowwise
            rows: ``mxcomm.torch.grouped_mm``'s SM90 path).
        fused: the exchanges' expert side in permute's order (``permute_align``): no separate
            permute or unpermute pass, forward or backward.
        permute_format: None, or the format the (separate) permute converts received quantized
            rows to (``"bf16"``: dequantized in the gather, for the bf16 GEMM).
        unpermute_grad_format: None, or the format unpermute's backward converts a quantized
            combine gradient to (``"bf16"`` for the bf16 GEMM's backward).
        wgrad: the fp8 GEMM's weight gradient, ``"fp8"`` or ``"bf16"`` (``grouped_mm``'s).
        fast_accum: the fp8 products summed without fp32 promotion (``grouped_mm``'s).
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

    def describe(self):
        """One line: the four directions, the layout of the expert side, the GEMM."""
        side = "fused (permute_align)" if self.fused else "permuted separately"
        gemm = (f"fp8 rowwise GEMM ({self.wgrad} wgrad)" if self.gemm == "fp8"
                else "bf16 GEMM")
        return (f"{self.name}: dispatch {self.dispatch}, combine {self.combine}, dispatch_grad "
                f"{self.dispatch_grad}, combine_grad {self.combine_grad}, {side}, {gemm}")


_RECIPES = (
    Recipe("bf16", "bf16", "bf16", "bf16", "bf16"),
    Recipe("mxfp8", "mxfp8", "bf16", "bf16", "mxfp8", permute_format="bf16",
           unpermute_grad_format="bf16"),
    Recipe("fp8_rowwise", "fp8_rowwise", "bf16", "mxfp8", "fp8_rowwise", gemm="fp8",
           fused=True),
    # fp8_rowwise with the gradients that reach the expert weights in bf16: the output gradient
    # on the wire (combine_grad) and the weight gradient's GEMM (wgrad); the weight gradients
    # 26.0 dB from float64 against 24.1 (bench/probe_wgrad.py). Not in the cost table yet, so
    # "auto" never picks it (bench/NOTES.md, 2026-11-27, "The expert weight gradients")
    Recipe("fp8_rowwise_gradbf16", "fp8_rowwise", "bf16", "mxfp8", "bf16", gemm="fp8",
           fused=True, wgrad="bf16"),
)
_BY_NAME = {r.name: r for r in _RECIPES}


def recipe_names():
    """Every name :func:`get_recipe` and ``ExpertParallel(recipe=...)`` take, ``"auto"`` first."""
    return (AUTO,) + tuple(_BY_NAME)


def get_recipe(name):
    """The :class:`Recipe` named ``name`` (not ``"auto"``, which is chosen per layout).

    Raises:
        ValueError: an unknown name (the message lists the recipes).
    """
    recipe = _BY_NAME.get(name)
    if recipe is None:
        raise ValueError(f"recipe: unknown recipe {name!r}; expected one of "
                         f"{', '.join(recipe_names())}")
    return recipe


def runnable(recipe, device):
    """True when the devices of class ``device`` run ``recipe`` as named: an fp8 GEMM needs
    ``"sm90"`` (elsewhere ``grouped_mm`` falls back to bf16 GEMMs: other numerics)."""
    return recipe.gemm != "fp8" or device == "sm90"


@dataclasses.dataclass(frozen=True)
class CostTable:
    """Measured fwd + bwd times of the whole EP layer, per recipe, at one shape.

    ``predict`` interpolates linearly in the rows per rank between the measured points (flat
    below the first, along the last segment above the last) after scaling the rows by the
    GEMM's work, ``rows * dim * hidden / (ref_dim * ref_hidden)``.

    Attributes:
        rows: ascending rows per rank of the measured points.
        ms: recipe name -> times (ms), one per point of ``rows``.
        ref_dim, ref_hidden: the shape measured.
        source: where the numbers come from.
    """

    rows: tuple
    ms: dict
    ref_dim: int
    ref_hidden: int
    source: str = ""

    def predict(self, name, rows, dim, hidden):
        """Predicted ms of recipe ``name`` at ``rows`` rows per rank of ``dim`` x ``hidden``."""
        x = rows * dim * hidden / (self.ref_dim * self.ref_hidden)
        points, ms = self.rows, self.ms[name]
        i = bisect.bisect_right(points, x)
        if i == 0:
            return ms[0]
        i = min(i, len(points) - 1)
        x0, x1 = points[i - 1], points[i]
        return ms[i - 1] + (ms[i] - ms[i - 1]) * (x - x0) / (x1 - x0)


#: The measurements the model reads (2 x H100, 2026-11-27, ``python -m mxcomm.bench pipeline``,
#: 8 experts per rank, uniform routing; bf16 with torch's exchange, fp8_rowwise fused).
H100_TABLE = CostTable(
    rows=(4096, 16384, 65536, 131072),
    ms={"bf16": (2.61, 4.06, 14.31, 29.11),
        "mxfp8": (2.63, 3.92, 13.49, 27.42),
        "fp8_rowwise": (5.48, 5.42, 11.52, 20.37)},
    ref_dim=7168, ref_hidden=2048,
    source="2 x H100, dim 7168, hidden 2048, 8 experts per rank, uniform routing")


def rows_per_rank(layout):
    """The most rows any rank sends in ``layout`` (its agreed ``sent`` table): the rows per rank
    of the table's measurements (uniform routing, where every rank also receives as many)."""
    return max(map(sum, layout.sent))


class Chooser:
    """``"auto"``'s answer for one shape and device class as intervals of rows per rank.

    The predictions are linear between the table's points, so the fastest recipe changes only
    at a point or where two lines cross; the chooser finds those bounds once, and a choice is
    then a bisection.

    Args:
        dim, hidden, device, table, margin: as :func:`choose_recipe`.
    Attributes:
        bounds: ascending points where the answer changes, in the table's rows (rows per rank
            scaled by ``dim * hidden / (ref_dim * ref_hidden)``: rows per rank at its shape).
        answers: the :class:`Recipe` of each interval (``len(bounds) + 1``).
    """

    def __init__(self, dim, hidden, *, device="cpu", table=H100_TABLE, margin=0.02):
        if device not in DEVICE_CLASSES:
            raise ValueError(f"choose_recipe: device: expected one of {DEVICE_CLASSES}, got "
                             f"{device!r}")
        self._scale = dim * hidden / (table.ref_dim * table.ref_hidden)
        if device == "cpu":  # the host backend: the table does not describe it
            self.bounds, self.answers = [], [_BY_NAME["bf16"]]
            return
        names = [r.name for r in _RECIPES if runnable(r, device) and r.name in table.ms]
        factor = {name: (1.0 - margin if name == "bf16" else 1.0) for name in names}

        def cost(name, x):  # in the table's rows (scaled), margin applied to bf16
            return factor[name] * table.predict(name, x, table.ref_dim, table.ref_hidden)

        points = list(table.rows)
        cuts = set(points)
        # below the first point the predictions are flat (no crossing); above the last they are
        # lines: a far edge finds where any two cross
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
        if not self.bounds:
            return self.answers[0]
        return self.answers[bisect.bisect_right(self.bounds,
                                                rows_per_rank(layout) * self._scale)]


def choose_recipe(layout, dim, hidden, *, device="cpu", table=H100_TABLE, margin=0.02):
    """The recipe ``"auto"`` runs for ``layout``: the one predicted fastest.

    Among the recipes the devices run (:func:`runnable`), every one meeting the SQNR thresholds
    (all do), the prediction of ``table`` decides; a recipe other than ``"bf16"`` replaces it
    only when predicted at least ``margin`` (a fraction) faster; ties keep the earlier recipe.
    On ``"cpu"`` the answer is ``"bf16"``. Deterministic in its arguments (every rank chooses
    alike); no host sync, no communication.

    Args:
        layout: a layout (``mxcomm.exchange_layout``); its ``sent`` table is read.
        dim, hidden: D (the token rows' width) and H (the expert GEMM's output width).
        device: the agreed device class (:data:`DEVICE_CLASSES`).
        table: a :class:`CostTable` (injectable: tests, re-measured tables).
        margin: the fraction by which another recipe must beat bf16.
    Returns:
        A :class:`Recipe`.
    Raises:
        ValueError: ``device`` not a device class.
    """
    return Chooser(dim, hidden, device=device, table=table, margin=margin)(layout)
