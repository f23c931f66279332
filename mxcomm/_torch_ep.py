"""The expert-parallel object (``mxcomm.torch.ExpertParallel``): the ``mxcomm.torch`` primitives
called as a recipe says, and torchtitan's experts on its rows (docs/design.md, "Recipes and the
expert-parallel object"). Glossary: M rows this rank routes, D dim, H the expert GEMM's output
width, E experts, E_local experts per rank, W ranks, P permuted rows
(``layout.permuted_rows(align)``).
"""

import types
import typing
import warnings
import weakref

import numpy
import torch

from . import recipes as _recipes
from ._torch_gemm import fp8_gemm_available

# mxcomm.torch re-exports this module: its submodules are imported when an object is built
# (``self._p``), so either may be imported first.


def _ranks(ranks):
    """``"rank 3"`` or ``"ranks 0, 2"``."""
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


class EPHandle(typing.NamedTuple):
    """What :meth:`ExpertParallel.dispatch` hands to :meth:`ExpertParallel.combine`: its
    ``layout``, the :class:`mxcomm.recipes.Recipe` that ran, ``permuted_indices`` (P,) int32 (the
    received row of each permuted row, -1: padding), ``group_offsets`` (E_local,) int32
    (cumulative group ends) and ``align``."""

    layout: object
    recipe: object
    permuted_indices: object
    group_offsets: object
    align: int


class ExpertParallel:
    """The token path of an MoE layer over one EP group, in one recipe's formats.

    Args:
        group: a torch.distributed ``ProcessGroup``, a 1-D ``DeviceMesh``, an mxcomm
            communicator, or None (torch.distributed's default group; or ``comm``).
        num_local_experts: E_local, the experts on each rank (the same on every rank).
        recipe: ``"auto"`` (default: per layout, ``mxcomm.recipes.choose_recipe``'s), or a
            recipe name to pin the numerics. Either runs as the group's topology asks
            (``Recipe.for_nodes``: ``"fp8_rowwise"``'s dispatch gradient is MXFP8 across nodes).
        comm: an mxcomm communicator (instead of ``group``).
        align: rows each expert group is padded to a multiple of (32: MX GEMMs; 16: SM90 fp8).
        hidden: H, for ``"auto"``'s prediction (None: D times the table's H / D).
        gemm_fallback: True: a pinned fp8-GEMM recipe off SM90 runs ``grouped_mm``'s bf16
            fallback; False (default): it raises.
        table: for ``"auto"``: None (``mxcomm.recipes.find_tables``' lookup), a ``CostTable``,
            or a table file's path.
        overlap: run the backward's dispatch-gradient exchange (and a separate permute's
            backward) on a side stream beside the expert weight-gradient GEMM (one
            ``grouped_mm`` on the rows ``dispatch`` returns; weights reading the same rows as a
            tuple). Same bits; eager only. None (default): for the calls whose recipe runs the
            fp8 GEMM, where it was measured never slower beyond noise and faster from 32768
            rows; True: every call; False: none. docs/design.md, "Overlap".

    Collectives at construction: the group's communicator (first use of a group), and one
    small host allgather agreeing on the recipe, E_local, ``align``, ``hidden``, the device
    class (the least capable rank's) and ``"auto"``'s table fingerprints, so that what follows
    raises on every rank alike, before any data moves.

    Raises:
        ValueError: ``num_local_experts`` or ``align`` not positive (this rank only); an unknown
            recipe, arguments that differ across ranks, ``overlap`` not None or a bool, for
            ``"auto"`` a table that fails to load (:func:`mxcomm.recipes.find_tables`) on some
            rank or tables that differ across ranks.
        RuntimeError: a pinned recipe the devices cannot run without ``gemm_fallback``.
        TypeError: ``group`` of another type (``mxcomm.torch.communicator_for``).

    Warns:
        RuntimeWarning (rank 0): ``"auto"`` over a group that spans nodes with only the built-in
        cost table, which was measured on one node: across nodes the network bounds the step,
        and the table under-rates the recipes that send fewer bytes (docs/design.md, "What
        bounds the layer across nodes").
    """

    def __init__(self, group=None, *, num_local_experts, recipe=_recipes.AUTO, comm=None,
                 align=32, hidden=None, gemm_fallback=False, table=None, overlap=None):
        from .torch._layout import exchange_layout
        from .torch._ops import a2a_combine, a2a_dispatch, communicator_for
        from .torch._permute import permute, unpermute
        self._p = types.SimpleNamespace(a2a_dispatch=a2a_dispatch, a2a_combine=a2a_combine,
                                        exchange_layout=exchange_layout, permute=permute,
                                        unpermute=unpermute)
        self.comm = comm if comm is not None else communicator_for(group)
        rank = self.comm.rank
        names = _recipes.recipe_names()
        if int(num_local_experts) <= 0 or int(align) <= 0:
            raise ValueError(f"ExpertParallel on rank {rank}: num_local_experts and align must "
                             f"be positive, got {num_local_experts} and {align}")
        self.num_local_experts = int(num_local_experts)
        self.align = int(align)
        self.hidden = hidden
        index = getattr(self.comm, "device", None)  # this rank's GPU, or None
        device = "cpu" if index is None else \
            "sm90" if fp8_gemm_available(torch.device("cuda", int(index))) else "cuda"
        #: ``"auto"``'s cost tables (``mxcomm.recipes.TableSet``), agreed across ranks.
        self.tables, failure = None, None
        if recipe == _recipes.AUTO:
            try:  # the device's name as cost tables record it
                self.tables = _recipes.find_tables(
                    "cpu" if index is None else torch.cuda.get_device_name(int(index)),
                    self.comm.size, table)
            except ValueError as e:
                failure = e
        mine = numpy.array([names.index(recipe) if recipe in names else -1,
                            _recipes.DEVICE_CLASSES.index(device), self.num_local_experts,
                            self.align, -1 if hidden is None else int(hidden),
                            failure is not None,
                            0 if self.tables is None else self.tables.fingerprint(),
                            2 if overlap is None else
                            int(overlap) if isinstance(overlap, bool) else -1],
                           dtype=numpy.int64)
        table_ = self.comm.allgather(mine, "ExpertParallel (arguments)")
        unknown = numpy.flatnonzero(table_[:, 0] < 0).tolist()
        if unknown:
            raise ValueError(f"ExpertParallel: unknown recipe on {_ranks(unknown)}"
                             f"{f' ({recipe!r} here)' if recipe not in names else ''}; "
                             f"expected one of {', '.join(names)}")
        bad = numpy.flatnonzero(table_[:, 7] < 0).tolist()
        if bad:
            raise ValueError(f"ExpertParallel: overlap on rank {bad[0]}"
                             f"{f' ({overlap!r})' if bad[0] == rank else ''}: expected None, "
                             f"True or False")
        for column, what in ((0, "recipe"), (2, "num_local_experts"), (3, "align"),
                             (4, "hidden"), (7, "overlap")):
            differs = numpy.flatnonzero(table_[:, column] != table_[0, column]).tolist()
            if differs:
                raise ValueError(f"ExpertParallel: {what} differs across ranks (rank 0 and rank "
                                 f"{differs[0]}); every rank of the group passes the same")
        failed = numpy.flatnonzero(table_[:, 5]).tolist()
        if failed:
            here = f" (here: {failure})" if failure is not None else ""
            raise ValueError(f"ExpertParallel: auto's cost table failed to load on "
                             f"{_ranks(failed)}{here}")
        differs = numpy.flatnonzero(table_[:, 6] != table_[0, 6]).tolist()
        if differs:
            raise ValueError(f"ExpertParallel: auto's cost tables differ across ranks (rank 0 "
                             f"and rank {differs[0]}; here from {self.tables.origin}), so the "
                             f"ranks could choose different recipes; give every rank the same "
                             f"table= or $MXCOMM_COST_TABLE, or the same cached tables (ranks "
                             f"on GPUs of different models hold different built-in tables)")
        #: The nodes the group spans (``comm.node_count``, agreed at ``init``): the recipes run as
        #: ``Recipe.for_nodes(nodes)``.
        self.nodes = self.comm.node_count
        if rank == 0 and self.tables is not None and self.tables.pinned is None and \
                not self.tables.cached and self.nodes > 1:
            warnings.warn("ExpertParallel(recipe='auto'): the group spans several nodes, and "
                          "auto has only its built-in cost table, measured on one node, where "
                          "the network is not the step; across nodes it under-rates the recipes "
                          "that send fewer bytes. Calibrate on these nodes (mpirun -n W python "
                          "-m mxcomm.bench calibrate) or pin a recipe ('fp8_rowwise' sends the "
                          "fewest bytes across nodes)", RuntimeWarning, stacklevel=2)
        #: The agreed device class (``mxcomm.recipes.DEVICE_CLASSES``): the least capable rank's.
        self.device_class = _recipes.DEVICE_CLASSES[int(table_[:, 1].min())]
        self.recipe_name = recipe
        #: None (``overlap=False``), or the ``mxcomm._torch_overlap.BackwardOverlap`` (its side
        #: streams; ``beside`` / ``behind`` count the backwards that overlapped / waited).
        self.overlap = None
        self._overlap_every_call = overlap is True
        if overlap is not False:
            from ._torch_overlap import BackwardOverlap
            self.overlap = BackwardOverlap()
        self._choosers = {}  # D -> mxcomm.recipes.Chooser ("auto")
        self._pinned = None if recipe == _recipes.AUTO else \
            _recipes.get_recipe(recipe).for_nodes(self.nodes)
        self._as_run = {}  # "auto": chosen Recipe -> Recipe.for_nodes(self.nodes)
        if self._pinned is not None and not gemm_fallback and \
                not _recipes.runnable(self._pinned, self.device_class):
            raise RuntimeError(f"ExpertParallel: recipe {recipe!r} needs SM90 fp8 grouped GEMMs "
                               f"(torch._scaled_grouped_mm on a compute capability 9.x GPU), "
                               f"which the group's devices ({self.device_class}) lack; pass "
                               f"gemm_fallback=True to run its GEMM in bf16, or choose another "
                               f"recipe")

    def chooser(self, dim):
        """``"auto"``'s :class:`mxcomm.recipes.Chooser` for rows of width ``dim`` (cached per
        D). RuntimeError for a pinned recipe."""
        if self.tables is None:
            raise RuntimeError(f"ExpertParallel: recipe {self.recipe_name!r} is pinned; only "
                               f"'auto' chooses")
        table = self.tables.table_for(dim, self.hidden)
        chooser = self._choosers.get(dim)
        if chooser is None or chooser.device != self.device_class or chooser.table is not table:
            chooser = self._choosers[dim] = _recipes.Chooser(
                dim, self.hidden if self.hidden is not None
                else dim * table.ref_hidden / table.ref_dim, device=self.device_class,
                table=table)
        return chooser

    def recipe_for(self, layout, dim):
        """The :class:`~mxcomm.recipes.Recipe` run for ``layout`` and rows of width ``dim``, as
        the group's nodes run it (``Recipe.for_nodes``). No host sync, no communication."""
        if self._pinned is not None:
            return self._pinned
        return self.as_run(self.chooser(dim)(layout))

    def as_run(self, recipe):
        """``recipe`` as this group runs it: ``recipe.for_nodes(self.nodes)``, made once."""
        if self.nodes == 1:  # on one node every recipe runs as named
            return recipe
        run = self._as_run.get(recipe)
        if run is None:
            run = self._as_run[recipe] = recipe.for_nodes(self.nodes)
        return run

    def dispatch(self, x, num_tokens_per_expert):
        """Send routed rows to their experts, in the recipe's formats, in permuted order.

        Args:
            x: (M, D) bf16 tensor, rows sorted by global expert, D % 32 == 0. Read;
                differentiable.
            num_tokens_per_expert: (E,) integer tensor, rows of ``x`` per global expert
                (E = W * E_local).
        Returns:
            ``(rows, group_offsets, handle)``: rows (P, D), expert-major, groups zero-padded to
            a multiple of ``align``, bf16 or (a fused fp8 recipe) an fp8 rowwise
            ``QuantizedTensor``, as ``grouped_mm`` takes them; group_offsets (E_local,) int32;
            an :class:`EPHandle`.
        Raises:
            ValueError, TypeError: bad counts (on every rank) or rows not matching them.
        Host syncs and collectives: ``exchange_layout``'s one host round; none else.
        """
        p = self._p
        layout = p.exchange_layout(num_tokens_per_expert, self.comm)
        recipe = self.recipe_for(layout, x.shape[-1])
        align = self.align
        if self.overlap is not None and (self._overlap_every_call or recipe.gemm == "fp8") \
                and not torch.compiler.is_compiling():
            rows, indices, offsets = self.overlap.dispatch(
                x, layout, precision=recipe.dispatch, grad_precision=recipe.dispatch_grad,
                align=align, fused=recipe.fused, out_format=recipe.permute_format)
        elif recipe.fused:
            rows, indices, offsets = p.a2a_dispatch(
                x, layout, precision=recipe.dispatch, grad_precision=recipe.dispatch_grad,
                permute_align=align)
        else:
            received = p.a2a_dispatch(x, layout, precision=recipe.dispatch,
                                      grad_precision=recipe.dispatch_grad)
            rows, indices, offsets = p.permute(received, layout, align=align,
                                               out_format=recipe.permute_format)
        return rows, offsets, EPHandle(layout, recipe, indices, offsets, align)

    def combine(self, y, handle):
        """Return the experts' output rows to the ranks that routed them.

        Args:
            y: (P, H) bf16 tensor in ``dispatch``'s permuted order (padding ignored). Read;
                differentiable (its gradient bf16, or a QuantizedTensor where the GEMM reads one).
            handle: the :class:`EPHandle` of the matching ``dispatch``.
        Returns:
            (M, H) bf16 tensor, in the order of ``dispatch``'s ``x``.
        Raises:
            TypeError: ``handle`` not an :class:`EPHandle`.
        """
        if not isinstance(handle, EPHandle):
            raise TypeError(f"combine: handle: expected the EPHandle dispatch returned, got "
                            f"{type(handle).__name__}")
        p, recipe, layout = self._p, handle.recipe, handle.layout
        if not recipe.fused:
            y = p.unpermute(y, handle.permuted_indices, layout,
                            grad_format=recipe.unpermute_grad_format)
        return p.a2a_combine(y, layout, precision=recipe.combine,
                             grad_precision=recipe.combine_grad,
                             permute_align=handle.align if recipe.fused else None)


def grouped_experts_class(parent_cls):
    """The subclass (one per ``parent_cls``, cached) of torchtitan 0.3's ``GroupedExperts`` whose
    grouped GEMMs are ``mxcomm.torch.grouped_mm``, fed :meth:`ExpertParallel.dispatch`'s rows.
    ``forward(x_RD, num_tokens_per_expert_E)`` (the padded group sizes) computes torchtitan's
    SwiGLU ``(silu(x w1^T) * (x w3^T)) w2^T`` per expert; on quantized rows in two GEMMs, over
    [w1 | w3] (one dgrad, so the backward overlap engages) and w2's in bf16 (docs/design.md,
    "The experts' GEMMs"). Plain rows, a False :meth:`_uses_mxcomm_gemm` or spmd_types type
    checking: torchtitan's forward (``grouped_mm`` in its ``_grouped_mm`` seam where used).
    """
    cached = _EXPERTS_CLASSES.get(parent_cls)
    if cached is not None:
        return cached

    class MxcommGroupedExperts(parent_cls):
        #: ``grouped_mm``'s ``wgrad`` for the w1|w3 GEMM (``"fp8"`` or ``"bf16"``)
        mxcomm_wgrad = "fp8"

        def _uses_mxcomm_gemm(self, x_RD):
            """True where this forward runs mxcomm's GEMMs (subclasses: by their config)."""
            return True

        def _grouped_mm(self, *, A, B_t, offs):
            if not self._uses_mxcomm_gemm(A):
                return super()._grouped_mm(A=A, B_t=B_t, offs=offs)
            from ._torch_gemm import grouped_mm
            return grouped_mm(A, B_t, offs)

        def forward(self, x_RD, num_tokens_per_expert_E):
            if not (self._uses_mxcomm_gemm(x_RD) and hasattr(x_RD, "qdata")) or \
                    _spmd_type_checking():
                return super().forward(x_RD, num_tokens_per_expert_E)
            from ._torch_gemm import grouped_mm
            w1, w2, w3 = (w.to_local() if hasattr(w, "to_local") else w
                          for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
            offs = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
            h13 = grouped_mm(x_RD, (w1.bfloat16().transpose(-2, -1),
                                    w3.bfloat16().transpose(-2, -1)), offs,
                             wgrad=self.mxcomm_wgrad)
            if torch.compiler.is_compiling():  # the compiler fuses torch's ops itself
                h1, h3 = h13.split(w1.shape[-2], dim=-1)
                h = torch.nn.functional.silu(h1) * h3
            else:
                h = _SwiGLU.apply(h13)
            return grouped_mm(h, w2.bfloat16().transpose(-2, -1), offs).type_as(x_RD)

    MxcommGroupedExperts.__name__ = MxcommGroupedExperts.__qualname__ = \
        f"Mxcomm{parent_cls.__name__}"
    _EXPERTS_CLASSES[parent_cls] = MxcommGroupedExperts
    return MxcommGroupedExperts


class _SwiGLU(torch.autograd.Function):
    """h = silu(h1) * h3 of h13 = [h1 | h3]: the same bits as ``F.silu(h1) * h3`` and its autograd.

    Forward:  h13 (P, 2F) -> h (P, F). Saved: h13 only (silu(h1) made again in the backward).
    Backward: dh (P, F) -> dh13 (P, 2F), both halves written into one tensor, so the GEMM over
              [w1 | w3] reads it with no joining copy.
    """

    @staticmethod
    def forward(ctx, h13):
        ctx.save_for_backward(h13)
        h1, h3 = h13.chunk(2, dim=-1)
        return torch.nn.functional.silu(h1) * h3

    @staticmethod
    def backward(ctx, dh):
        (h13,) = ctx.saved_tensors
        h1, h3 = h13.chunk(2, dim=-1)
        dh13 = torch.empty_like(h13)
        d1, d3 = dh13.chunk(2, dim=-1)
        torch.mul(dh, torch.nn.functional.silu(h1), out=d3)
        torch.ops.aten.silu_backward.grad_input(dh * h3, h1, grad_input=d1)
        return dh13


def _spmd_type_checking():
    """True under torchtitan's spmd_types type checking (mxcomm's GEMMs carry no SPMD types)."""
    from torchtitan.distributed.utils import get_spmd_backend
    if get_spmd_backend() != "spmd_types":
        return False
    import spmd_types
    return spmd_types.is_type_checking()


#: parent class -> its :func:`grouped_experts_class` (one per parent for isinstance, compile)
_EXPERTS_CLASSES = weakref.WeakKeyDictionary()
