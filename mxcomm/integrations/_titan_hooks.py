"""The exchange hooks of torchtitan's token dispatcher on mxcomm (mxcomm.integrations.torchtitan).

One path, eager and compiled: the layout replaces torchtitan's count exchange, the dispatch and
combine with ``permute_align=A`` its permute and unpermute; a :class:`_Path` is what varies per
call. docs/design.md, "torchtitan 0.3".

Glossary (torchtitan's suffixes): N routed rows this rank sends, R rows it receives, P the
permuted bound (``layout.permuted_rows(A)``), D dim, E experts, e local experts.
"""

import dataclasses

#: A of a ``fused`` recipe: the fp8 grouped GEMMs' and MX blocks' multiple of rows.
RECIPE_ALIGN = 32


@dataclasses.dataclass(frozen=True)
class _Path:
    """One call's way through the dispatcher.

    Attributes:
        dispatch, combine, dispatch_grad, combine_grad: the wire formats.
        align: A, each local expert's group padded to a multiple of it (1: no padding).
        keep: the experts get the rows as delivered (a QuantizedTensor); False: plain rows in
            the activations' dtype.
        recipe: the recipe's name where ``"auto"`` chose, else None.
    """

    dispatch: str
    combine: str
    dispatch_grad: str
    combine_grad: str
    align: int = 1
    keep: bool = False
    recipe: object = None


def precisions(config):
    """The four wire formats of a dispatcher config, the backward ones resolved by direction;
    ValueError naming the field of an unknown precision."""
    from mxcomm import a2a
    dispatch = config.dispatch_precision
    combine = config.combine_precision
    values = {"dispatch_precision": dispatch, "combine_precision": combine,
              "dispatch_grad_precision": config.dispatch_grad_precision or combine,
              "combine_grad_precision": config.combine_grad_precision or dispatch}
    for field, value in values.items():
        a2a._check_precision(value, field)
    return values


class _Fused:
    """Passed between the hooks in place of torchtitan's counts and splits: the layout (or a
    LayoutHandle), the call's :class:`_Path`, the permuted groups' ends."""

    def __init__(self, layout):
        self.layout = layout
        self.path = None
        self.offsets = None


def plain(t, dtype):
    """``t`` as a plain tensor of ``dtype`` (a QuantizedTensor dequantized, straight-through)."""
    from mxcomm import torch as mxt
    if isinstance(t, mxt.QuantizedTensor):
        t = t.dequantize()
    return t if t.dtype == dtype else t.to(dtype)


class MxcommExchanges:
    """The exchange hooks of torchtitan's ``AllToAllTokenDispatcher`` on mxcomm (mixed in first).

    Shapes: ``x`` (N, D) routed rows sorted by global expert, ``num_local_tokens_per_expert_E``
    (E,) int64; the dispatch returns (P, D) permuted rows, groups padded to the path's A, a
    QuantizedTensor where the path keeps them, else ``x``'s dtype; torchtitan's counts become
    the padded groups' sizes.

    The path: A = ``permute_align`` (keeping the rows), else TorchAO's ``pad_multiple`` or 1;
    with ``"auto"``, the recipe chosen per call from the layout in eager, from the rows routed
    when compiled (torchtitan pads every rank's tokens alike, so ranks choose alike).
    """

    def __init__(self, config):
        super().__init__(config)
        for field, value in precisions(config).items():
            setattr(self, field, value)
        self.permute_align = getattr(config, "permute_align", 0)
        #: None, or the dispatch gradient's format where the EP group spans nodes (a pinned
        #: recipe's ``Recipe.for_nodes``; taken at :meth:`wire_meshes`)
        self.dispatch_grad_across_nodes = getattr(config, "dispatch_grad_across_nodes", None)
        if self.dispatch_grad_across_nodes is not None:
            from mxcomm import a2a
            a2a._check_precision(self.dispatch_grad_across_nodes, "dispatch_grad_across_nodes")
        self.recipe = getattr(config, "recipe", None)
        self.hidden = getattr(config, "hidden", 0) or None
        self.dim = getattr(config, "dim", 0)
        self._ep = None
        self._paths = {}  # recipe name -> its _Path ("auto": made once per recipe)
        align = self.permute_align or getattr(self, "pad_multiple", None) or 1
        self._path = _Path(self.dispatch_precision, self.combine_precision,
                           self.dispatch_grad_precision, self.combine_grad_precision, align,
                           self.permute_align > 0)
        overlap = getattr(config, "overlap", False)
        if not isinstance(overlap, bool) or (overlap and not self.permute_align
                                             and self.recipe != "auto"):
            raise ValueError(f"overlap: expected False, or True where mxcomm permutes "
                             f"(permute_align > 0 or recipe 'auto': the rows must reach "
                             f"mxcomm's experts as dispatched), got {overlap!r} with "
                             f"permute_align {self.permute_align}")
        #: None, or the ``mxcomm._torch_overlap.BackwardOverlap`` of ``overlap=True`` (its
        #: ``beside`` / ``behind`` count the dispatch backwards that overlapped / waited)
        self.backward_overlap = None
        if overlap:
            from mxcomm._torch_overlap import BackwardOverlap
            self.backward_overlap = BackwardOverlap()

    def wire_meshes(self, *, ep_mesh):
        """torchtitan's hook, on every rank outside any trace. With ``"auto"`` and EP > 1 it
        builds the ``ExpertParallel`` that chooses (one host allgather) and the chooser of
        ``dim`` now, so a compiled region only reads it; ValueError (a bad cost table) on
        every rank. With ``dispatch_grad_across_nodes`` it takes the group's communicator
        (collective on its first use) and, where the group spans nodes, that format for the
        dispatch gradient."""
        super().wire_meshes(ep_mesh=ep_mesh)
        across = self.dispatch_grad_across_nodes
        if across is not None and ep_mesh is not None and self.recipe != "auto":
            from mxcomm.torch import communicator_for  # the group's nodes, agreed at its init
            if communicator_for(ep_mesh).node_count > 1:
                self._path = dataclasses.replace(self._path, dispatch_grad=across)
        if self.recipe == "auto" and ep_mesh is not None:
            from mxcomm.torch import ExpertParallel
            self._ep = ExpertParallel(ep_mesh, hidden=self.hidden,
                                      num_local_experts=self.num_experts // ep_mesh.size())
            if self.dim:
                self._ep.chooser(self.dim)

    def _path_for(self, layout, x):
        """The call's :class:`_Path`: the config's, or ``"auto"``'s choice."""
        if self.recipe != "auto":
            return self._path
        if self._ep is None:
            raise RuntimeError("recipe 'auto': the dispatcher was not wired to its EP mesh "
                               "(torchtitan calls wire_meshes when it parallelizes the model)")
        from mxcomm.layout import Layout
        chooser = self._ep.chooser(x.shape[-1])
        recipe = self._ep.as_run(chooser(layout) if isinstance(layout, Layout)
                                 else chooser.for_rows(x.shape[0]))
        path = self._paths.get(recipe.name)
        if path is None:
            path = self._paths[recipe.name] = _Path(
                recipe.dispatch, recipe.combine, recipe.dispatch_grad, recipe.combine_grad,
                RECIPE_ALIGN if recipe.fused else 1, recipe.gemm == "fp8", recipe.name)
        return path

    @staticmethod
    def _torchtitan_path():
        """True under SPMD type checking (mxcomm's results carry no SPMD type): torchtitan's
        exchanges run. RuntimeError under torch.export's non-strict tracing."""
        import torch
        # dynamo is not export's non-strict tracing; torch 2.11 has no probe
        probe = getattr(torch.compiler, "_is_non_strict_tracing", None)
        if not torch.compiler.is_compiling() and probe is not None and probe():
            raise RuntimeError("mxcomm's token exchanges do not run under torch.export's "
                               "non-strict tracing; use torch.compile, or torchtitan's own "
                               "dispatcher for export")
        from mxcomm._torch_ep import _spmd_type_checking
        return _spmd_type_checking()

    def _token_count_exchange(self, num_local_tokens_per_expert_E, pg, ep_size):
        if self._torchtitan_path():
            return super()._token_count_exchange(num_local_tokens_per_expert_E, pg, ep_size)
        from mxcomm import torch as mxt
        return mxt.exchange_layout(num_local_tokens_per_expert_E, pg)

    def _sync_token_count_exchange(self, num_local_tokens_per_expert_E,
                                   num_global_tokens_per_local_expert_EP_e, ep_size):
        from mxcomm.layout import Layout
        from mxcomm.torch._ops import LayoutHandle
        layout = num_global_tokens_per_local_expert_EP_e
        if isinstance(layout, (Layout, LayoutHandle)):
            fused = _Fused(layout)
            return fused, fused, fused
        return super()._sync_token_count_exchange(
            num_local_tokens_per_expert_E, num_global_tokens_per_local_expert_EP_e, ep_size)

    def _dispatch_token_exchange(self, routed_input_ND, pg, output_splits, input_splits):
        if type(input_splits) is not _Fused:
            return super()._dispatch_token_exchange(routed_input_ND, pg, output_splits,
                                                    input_splits)
        import torch

        from mxcomm import torch as mxt
        fused = input_splits
        path = fused.path = self._path_for(fused.layout, routed_input_ND)
        if self.backward_overlap is not None and path.keep and \
                not torch.compiler.is_compiling():
            # the same call, its backward beside the experts' wgrad (eager only)
            rows, _, fused.offsets = self.backward_overlap.dispatch(
                routed_input_ND, fused.layout, precision=path.dispatch,
                grad_precision=path.dispatch_grad, align=path.align, fused=True)
            return rows
        rows, _, fused.offsets = mxt.a2a_dispatch(
            routed_input_ND, fused.layout, precision=path.dispatch,
            grad_precision=path.dispatch_grad, permute_align=path.align)
        return rows if path.keep else plain(rows, routed_input_ND.dtype)

    def _permute(self, routed_input_RD, num_global_tokens_per_local_expert_E):
        fused = num_global_tokens_per_local_expert_E
        if type(fused) is not _Fused:
            return super()._permute(routed_input_RD, num_global_tokens_per_local_expert_E)
        import torch
        offsets = fused.offsets  # the padded groups' ends: their sizes, as torchtitan's counts
        counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
        return routed_input_RD.shape, routed_input_RD, None, counts

    def _unpermute(self, routed_output_RD, input_shape, permuted_indices):
        if permuted_indices is None:  # permuted by mxcomm: the combine takes the rows as they are
            return routed_output_RD
        return super()._unpermute(routed_output_RD, input_shape, permuted_indices)

    def _combine_token_exchange(self, routed_output_RD, pg, input_splits, output_splits):
        if type(input_splits) is not _Fused:
            return super()._combine_token_exchange(routed_output_RD, pg, input_splits,
                                                   output_splits)
        from mxcomm import torch as mxt
        path = input_splits.path
        out = mxt.a2a_combine(routed_output_RD, input_splits.layout, precision=path.combine,
                              grad_precision=path.combine_grad, permute_align=path.align)
        return plain(out, routed_output_RD.dtype)
