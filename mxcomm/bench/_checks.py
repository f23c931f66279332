"""What the pipeline benchmark shows on any machine: exactness of the data movement, bytes moved.

Exactness: every mxcomm step of a traced pipeline run (the layout exchange, dispatch, permute,
unpermute, combine, forward and backward) is compared, bit for bit, with an independent reference
computed from the same inputs: ``torch.distributed.all_to_all_single`` of the same bytes for the
exchanges (quantized with the step's format, ``Format.quantize``, first, and dequantized after,
where the step's precision is a quantized format), an index-based gather/scatter in torch for
permute and unpermute (padding rows: data 0 and the format's padding scale, 1.0 for fp8_rowwise),
a torch re-computation of the documented conversion for a permute that converts (MXFP8 -> fp8
rowwise rescale, :meth:`Checker._converted`; MXFP8 -> bf16 decode, :meth:`Checker._decoded`), and an MPI allgather of the counts for the layout. Counts are rows
whose bytes differ, summed over ranks. The exchanges of variants that use torch's own
(``Variant.torch_a2a``) are not checked; a step with no reference is reported "skipped", never as
exact.

Bytes on the wire: rows a rank sends to other ranks (rows it keeps are not counted) times the bytes
of a row in the step's precision (bf16: 2 D; MXFP8: D e4m3 bytes + D / 32 e8m0 scales; fp8_rowwise:
D e4m3 bytes + one float32 scale), summed over ranks. Glossary: M rows per rank, N rows received,
D dim, H hidden, P permuted rows.
"""

import math

import numpy

#: The four directions of the exchanges: (name, width attribute of the case, splits it sends).
DIRECTIONS = (("dispatch", "dim", "input"), ("combine", "hidden", "output"),
              ("dispatch_grad", "dim", "output"), ("combine_grad", "hidden", "input"))
#: The steps checked, in pipeline order (forward, then each step's backward).
#: The verdict of a step a fused variant runs inside an exchange (checked there).
FUSED = object()
STEPS = ("layout", "dispatch", "permute index", "permute", "unpermute", "combine", "combine bwd",
         "unpermute bwd", "permute bwd", "dispatch bwd")


def row_bytes(precision, width):
    """Bytes of one row of ``width`` bf16 elements in ``precision`` (any format name of
    ``mxcomm.formats``: its ``bytes_per_row``). Raises ValueError naming the formats."""
    from mxcomm.formats import get_format
    return get_format(precision).bytes_per_row(width)


def precisions(variant):
    """``{direction: precision}`` of a variant (the baseline moves everything in bf16)."""
    return {name: getattr(variant, name) for name, _, _ in DIRECTIONS}


def wire_rows(variant, case, input_splits, output_splits, rank, allreduce_sum, allreduce_max,
              small_exchange=None):
    """Rows of the ``wire`` table for one variant: per direction, rows and bytes sent between
    ranks, summed over ranks. A quantized direction whose exchange is small (no rank sends more
    than the communicator's ``small_exchange_bytes`` of bf16 rows to its peers: its rule, docs/
    design.md "Small exchanges travel unquantized") counts its rows as bf16, and its precision
    reads ``"<name> (bf16 on the wire)"``.

    Args:
        variant: a ``_moe.Variant``. case: has ``dim``, ``hidden`` and ``label``.
        input_splits, output_splits: this rank's splits (lists of W ints). rank: this rank.
        allreduce_sum, allreduce_max: map a list of numbers to their element-wise sums (maxima)
            over ranks.
        small_exchange: ``mxcomm.route.small`` bound to the communicator (``(rows,
            row_bytes)`` -> bool), or None (no exchange is small).
    """
    from mxcomm.formats import get_format
    splits = {"input": input_splits, "output": output_splits}
    off_rank = [sum(splits[side]) - splits[side][rank] for _, _, side in DIRECTIONS]
    largest = allreduce_max(off_rank)
    rows, nbytes, labels = [], [], []
    for (name, width_attr, _), sent, most in zip(DIRECTIONS, off_rank, largest):
        precision, width = getattr(variant, name), getattr(case, width_attr)
        if get_format(precision).quantized and small_exchange is not None and \
                small_exchange(most, width * 2):
            precision, label = "bf16", f"{precision} (bf16 on the wire)"
        else:
            label = precision
        rows.append(sent)
        nbytes.append(sent * row_bytes(precision, width))
        labels.append(label)
    totals = allreduce_sum(rows + nbytes)
    n = len(DIRECTIONS)
    return [{"shape": case.label, "variant": variant.name, "direction": name,
             "precision": labels[i], "rows": int(totals[i]),
             "bytes": int(totals[n + i])} for i, (name, _, _) in enumerate(DIRECTIONS)]


def permutation_index(counts, num_local_experts, align, num_rows):
    """The expected ``(indices (P,), group_offsets (E_local,))`` of ``permute``, by a loop over the
    (local expert, source rank) segments; ``counts`` rank-major host ints."""
    ranks = len(counts) // num_local_experts
    src_start = numpy.cumsum([0] + list(counts[:-1]))
    padded = -(-(num_rows + num_local_experts * align) // align) * align
    indices = numpy.full(padded, -1, dtype=numpy.int64)
    offsets, pos = [], 0
    for e in range(num_local_experts):
        for r in range(ranks):
            k = r * num_local_experts + e
            indices[pos:pos + counts[k]] = numpy.arange(src_start[k], src_start[k] + counts[k])
            pos += counts[k]
        pos = -(-pos // align) * align
        offsets.append(pos)
    return indices, offsets


class Checker:
    """Bit-exact checks of one traced pipeline run (``pipeline._Case.trace``).

    Args:
        rt: the benchmark's Runtime (torch.distributed initialized). case: the shape's inputs.
        align: rows of permute's padding.
    """

    def __init__(self, rt, case, align):
        self.rt, self.case, self.align = rt, case, align

    # ---- conversions ---------------------------------------------------------------------
    @staticmethod
    def _bytes(t):
        """(rows, bytes) uint8 view of a tensor; an MXFP8 tensor's data and scales side by side."""
        import torch
        if hasattr(t, "qdata"):  # a QuantizedTensor of any format: data bytes, scale bytes
            return torch.cat([_byte_rows(t.qdata), _byte_rows(t.scales)], dim=1)
        return _byte_rows(t.detach())

    def _quantized(self, t, precision):
        """(rows, format.bytes_per_row(D)) uint8: the bf16 tensor ``t`` quantized in the format
        ``precision`` (``Format.quantize``), data bytes then scale bytes."""
        import torch
        from mxcomm.formats import get_format
        q = get_format(precision).quantize(self.rt.from_torch(t.detach().contiguous()))
        parts = [_byte_rows(self.rt.to_torch(a)) for a in (q.data, q.scales)]
        return torch.cat(parts, dim=1)

    def _dequantized(self, rows, width, precision):
        """(rows, 2 width) uint8 bytes of the bf16 dequantization of ``rows`` quantized in the
        format ``precision`` (as :meth:`_quantized` lays them out)."""
        import torch
        from mxcomm.formats import get_format
        fmt = get_format(precision)
        rows = rows.contiguous()
        scale_torch = torch.float32 if fmt.scale_dtype == numpy.float32 else torch.uint8
        scales = rows[:, width:].contiguous().view(scale_torch).reshape(
            fmt.scales_shape(rows.shape[0], width))
        q = fmt.wrap(self.rt.from_torch(rows[:, :width].contiguous()),
                     self.rt.from_torch(scales.contiguous()))
        return self._bytes(self.rt.to_torch(q.dequantize()))

    def _exchange(self, rows, send, recv):
        """``torch.distributed.all_to_all_single`` of the uint8 ``rows``: the reference."""
        import torch.distributed as dist
        out = rows.new_empty((sum(recv), rows.shape[1]))
        dist.all_to_all_single(out, rows.contiguous(), list(recv), list(send))
        return out

    def _moved(self, t, precision, send, recv, *, dequantized=False):
        """Expected bytes of a step moving the bf16 tensor ``t`` in ``precision``: bf16 rows moved
        as they are; MXFP8 rows quantized, moved, and dequantized to bf16 if ``dequantized``."""
        if precision == "bf16":
            return self._exchange(self._bytes(t), send, recv)
        moved = self._exchange(self._quantized(t, precision), send, recv)
        return self._dequantized(moved, t.shape[1], precision) if dequantized else moved

    @staticmethod
    def _padding_row(precision, width):
        """(bytes,) uint8 NumPy row of a padding row of ``permute`` in ``precision``: data 0,
        then the format's ``padding_scale`` in its scale dtype (as :meth:`_bytes` lays rows out)."""
        from mxcomm.formats import get_format
        fmt = get_format(precision)
        if not fmt.quantized:
            return numpy.zeros(fmt.bytes_per_row(width), dtype=numpy.uint8)
        scales = numpy.full(fmt.scales_shape(1, width), fmt.padding_scale, dtype=fmt.scale_dtype)
        return numpy.concatenate([numpy.zeros(width, dtype=numpy.uint8),
                                  scales.reshape(-1).view(numpy.uint8)])

    @staticmethod
    def _gather(rows, indices, padding=None):
        """rows[indices[p]] (torch indexing); where indices[p] < 0 the row ``padding`` ((bytes,)
        uint8 NumPy, see :meth:`_padding_row`), or zeros."""
        import torch
        out = rows.new_zeros((indices.shape[0], rows.shape[1]))
        keep = indices >= 0
        if padding is not None:
            out[~keep] = torch.as_tensor(padding, device=rows.device)
        out[keep] = rows[indices[keep]]
        return out

    def _permuted(self, h, indices, source, target):
        """Expected (P, bytes) uint8 of ``permute``'s output: rows ``indices`` of the received
        rows ``h`` in the format ``source``, gathered as they are (``target`` None or equal) or
        converted to ``target`` (:meth:`_converted`); None where no reference exists."""
        width = self.case.dim
        if target is None or target == source:
            return self._gather(self._bytes(h), indices, self._padding_row(source, width))
        if (source, target) == ("mxfp8", "fp8_rowwise"):
            return self._converted(h, indices)
        if (source, target) == ("mxfp8", "bf16"):
            return self._decoded(h, indices)
        return None

    @staticmethod
    def _decoded(mx, indices):
        """(P, 2 D) uint8: rows ``indices`` (P,) int64 of the (N, D) MXFP8Tensor ``mx`` as bf16,
        decoded in torch from OCP MX v1.0: e4m3 * 2^(s - 127), exact in fp32, rounded to nearest
        even in bf16; a NaN block scale (0xFF) gives NaN; padding rows 0."""
        import torch
        keep = indices >= 0
        rows = indices[keep]
        data = mx.qdata.view(torch.float8_e4m3fn)[rows].float()             # (n, D), exact
        block = mx.scales.view(torch.uint8)[rows].to(torch.int32)           # (n, D / 32)
        n, d = data.shape
        values = data.reshape(n, d // 32, 32) * torch.exp2((block - 127).float())[..., None]
        values[block == 0xFF] = float("nan")
        out = torch.zeros((indices.shape[0], d), dtype=torch.bfloat16, device=data.device)
        out[keep] = values.reshape(n, d).to(torch.bfloat16)
        return out.view(torch.uint8)

    @staticmethod
    def _converted(mx, indices):
        """(P, D + 4) uint8: rows ``indices`` (P,) int64 of the (N, D) MXFP8Tensor ``mx`` as fp8
        rowwise rows, recomputed in torch from the rule that
        ``mxcomm.rowwise.mx_to_rowwise_permute`` documents: row scale 2^(r - 127), with
        r = max(max block scale, 1);
        each element of block b (scale s_b) RNE_e4m3(e4m3 * 2^(s_b - r)) (e4m3 NaNs kept);
        a NaN block scale (0xFF) gives scale NaN and elements 0x7F; padding rows data 0, scale
        1.0."""
        import torch
        keep = indices >= 0
        rows = indices[keep]
        data = mx.qdata.view(torch.uint8)[rows]                             # (n, D) e4m3 bits
        block = mx.scales.view(torch.uint8)[rows].to(torch.int32)           # (n, D / 32)
        n, d = data.shape
        smax = block.amax(dim=1) if n and block.shape[1] else block.new_zeros(n)
        r = smax.clamp(min=1)
        mult = torch.exp2((block - r[:, None]).to(torch.float32))           # exact powers of 2
        values = data.view(torch.float8_e4m3fn).float().reshape(n, d // 32, 32) * mult[..., None]
        conv = values.to(torch.float8_e4m3fn).view(torch.uint8).reshape(n, d)
        conv = torch.where((data & 0x7F) == 0x7F, data, conv)
        bits = r << 23
        nan_row = smax == 0xFF
        conv[nan_row] = 0x7F
        bits[nan_row] = 0x7FC00000
        out_data = data.new_zeros((indices.shape[0], d))
        out_scale = torch.ones(indices.shape[0], dtype=torch.float32, device=data.device)
        out_data[keep] = conv
        out_scale[keep] = bits.view(torch.float32)
        return torch.cat([out_data, out_scale.reshape(-1, 1).view(torch.uint8)], dim=1)

    @staticmethod
    def _scatter(rows, indices, num_rows):
        """out[indices[p]] = rows[p] for indices[p] >= 0 (torch indexing), zero elsewhere."""
        out = rows.new_zeros((num_rows, rows.shape[1]))
        keep = indices >= 0
        out[indices[keep]] = rows[keep]
        return out

    # ---- the checks ----------------------------------------------------------------------
    def _layout_ok(self, state):
        """The layout exchange's counts and splits, against an MPI allgather of all counts."""
        e_local, me = self.case.e_local, self.rt.rank
        counts = numpy.array(self.rt.allgather(self.case.counts.cpu().tolist()))  # [j, e]
        mine = counts[:, me * e_local:(me + 1) * e_local]                                 # [r, e]
        return ([int(c) for c in state["group"].cpu().tolist()] == mine.reshape(-1).tolist()
                and list(state["input_splits"]) == counts[me].reshape(-1, e_local).sum(1).tolist()
                and list(state["output_splits"]) == mine.sum(1).tolist())

    def run(self, variant, state, grads, results):
        """Rows of the ``exactness`` table for one variant's traced run (counts summed over ranks).

        The exchanges of a torch-exchange variant (``Variant.torch_a2a``: bf16, bf16+fp8gemm)
        are torch's own, so only its layout, permute and unpermute are checked. A step without
        a reference (a permute conversion other than MXFP8 -> fp8 rowwise or bf16) gives a
        "skipped" row.

        Args:
            variant: a ``_moe.Variant``.
            state, grads, results: ``pipeline._Case.trace``'s: every stage's output (``"h"``,
                ``"p"``, ``"y_"``, ``"u"``, ``"out"``, layout entries), the gradient each
                received, and ``"input_grad"``.
        Returns:
            Rows ``{shape, variant, step, precision, rows, rows_differ, result}``; ``result`` is
            ``"exact"``, ``"<differ>/<rows> rows differ"``, ``"skipped"`` or, for a step a fused
            variant runs inside an exchange, ``"in the exchange"``.
        """
        import torch
        case, recv = self.case, state["output_splits"]
        group = [int(c) for c in state["group"].cpu().tolist()]
        index, offsets = permutation_index(group, case.e_local, self.align, sum(recv))
        idx = torch.as_tensor(index, device=case.x.device)
        index_ok = bool(torch.equal(state["indices"].to(torch.int64), idx)) and \
            [int(v) for v in state["offs"].cpu().tolist()] == offsets
        p = precisions(variant)
        # (step, precision of the rows ("" for the index checks), got (rows, bytes) uint8, expected
        # the same, or got None and a verdict)
        checks = [("layout", "", None, self._layout_ok(state))]
        steps = self._fused_checks if variant.fused else self._separate_checks
        checks += steps(variant, state, grads, results, p, idx, index_ok)
        # A missing reference is the same on every rank (it depends on the variant only).
        counts = [n for _, _, got, want in checks for n in _differ(got, want)]
        totals = self.rt.allreduce_sum(counts)
        rows = []
        for i, (step, precision, got, want) in enumerate(checks):
            differ, total = int(totals[2 * i]), int(totals[2 * i + 1])
            if want is None:
                result = "skipped"
            elif want is FUSED:
                result = "in the exchange"
            else:
                result = "exact" if differ == 0 else f"{differ}/{total} rows differ"
            rows.append({"shape": case.label, "variant": variant.name, "step": step,
                         "precision": precision, "rows": total, "rows_differ": differ,
                         "result": result})
        return rows


    def _separate_checks(self, variant, state, grads, results, p, idx, index_ok):
        """The checks of the steps run one by one (every variant but the fused ones)."""
        case, send, recv = self.case, state["input_splits"], state["output_splits"]
        mx = not variant.torch_a2a
        checks = []
        if mx:
            checks.append(("dispatch", p["dispatch"], self._bytes(state["h"]),
                           self._moved(case.x, p["dispatch"], send, recv)))
        checks += [("permute index", "", None, index_ok),
                   ("permute", variant.permute_format or p["dispatch"], self._bytes(state["p"]),
                    self._permuted(state["h"], idx, p["dispatch"], variant.permute_format)),
                   ("unpermute", "bf16", self._bytes(state["u"]),
                    self._scatter(self._bytes(state["y_"]), idx, sum(recv)))]
        if mx:
            checks += [("combine", p["combine"], self._bytes(state["out"]),
                        self._moved(state["u"], p["combine"], recv, send, dequantized=True)),
                       ("combine bwd", p["combine_grad"], self._bytes(grads["u"]),
                        self._moved(case.grad_out, p["combine_grad"], send, recv))]
        grad_format = variant.unpermute_grad_format
        checks += [("unpermute bwd", grad_format or p["combine_grad"], self._bytes(grads["y_"]),
                    self._permuted(grads["u"], idx, p["combine_grad"], grad_format)
                    if grad_format else
                    self._gather(self._bytes(grads["u"]), idx,
                                 self._padding_row(p["combine_grad"], case.hidden))),
                   ("permute bwd", "bf16", self._bytes(grads["h"]),
                    self._scatter(self._bytes(grads["p"]), idx, sum(recv)))]
        if mx:
            checks.append(("dispatch bwd", p["dispatch_grad"], self._bytes(results["input_grad"]),
                           self._moved(grads["h"], p["dispatch_grad"], recv, send,
                                       dequantized=True)))
        return checks

    def _fused_checks(self, variant, state, grads, results, p, idx, index_ok):
        """The checks of a fused variant (``Variant.fused``): each exchange and its permute (or
        unpermute) against the reference exchange followed by the reference gather (or
        scatter), under the exchange's step; the permute steps read "in the exchange"."""
        import torch
        case, send, recv = self.case, state["input_splits"], state["output_splits"]
        n = sum(recv)
        u = self._scatter(self._bytes(state["y_"]), idx, n).view(torch.bfloat16)
        h_grad = self._scatter(self._bytes(grads["p"]), idx, n).view(torch.bfloat16)
        return [
            ("dispatch", p["dispatch"], self._bytes(state["p"]),
             self._gather(self._moved(case.x, p["dispatch"], send, recv), idx,
                          self._padding_row(p["dispatch"], case.dim))),
            ("permute index", "", None, index_ok),
            ("permute", "", None, FUSED), ("unpermute", "", None, FUSED),
            ("combine", p["combine"], self._bytes(state["out"]),
             self._moved(u, p["combine"], recv, send, dequantized=True)),
            ("combine bwd", p["combine_grad"], self._bytes(grads["y_"]),
             self._gather(self._moved(case.grad_out, p["combine_grad"], send, recv), idx,
                          self._padding_row(p["combine_grad"], case.hidden))),
            ("unpermute bwd", "", None, FUSED), ("permute bwd", "", None, FUSED),
            ("dispatch bwd", p["dispatch_grad"], self._bytes(results["input_grad"]),
             self._moved(h_grad, p["dispatch_grad"], recv, send, dequantized=True))]


def _byte_rows(t):
    """(rows, bytes per row) uint8 view of the torch tensor ``t`` (rows, ...), C-contiguous.

    A rank may receive no rows: ``reshape(0, -1)`` cannot size such a tensor, and an empty tensor
    may carry strides a dtype view refuses, so its (0, bytes per row) tensor is made anew.
    """
    import torch
    width = math.prod(t.shape[1:]) * t.element_size()
    if t.shape[0] == 0:
        return torch.empty((0, width), dtype=torch.uint8, device=t.device)
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], width)


def _differ(got, want):
    """``(rows that differ, rows)`` of two (rows, bytes) uint8 tensors; with ``got`` None,
    ``want`` is a verdict counted as one row; with ``want`` None (no reference: skipped) or
    FUSED, ``(0, rows of got)``."""
    if want is None or want is FUSED:
        return 0, (0 if got is None else got.shape[0])
    if got is None:
        return (0 if want else 1), 1
    rows = max(got.shape[0], want.shape[0])
    if got.shape != want.shape:
        return rows, rows
    return (int((got != want).any(dim=1).sum()) if got.numel() else 0), rows
