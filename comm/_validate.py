"""Argument checks of the communicators' calls: local checks first, then (unless validation is off)
one agreement round, so an error on any rank raises the same exception on every rank."""

import itertools
import operator

import numpy


_INT64_MAX = 2**63 - 1


def as_counts(values, name, rank, size):
    """``values`` (``size`` integers) as a list of non-negative Python ints fitting int64.
    TypeError: not a sequence of integers; ValueError: wrong length or a negative entry (messages
    name ``name`` and ``rank``)."""
    # fast paths: ints in a list/tuple, or a 1-D integer array; else NumPy words the errors
    kind = type(values)
    if kind is list or kind is tuple:
        if size and len(values) == size and all(type(v) is int for v in values) and \
                min(values) >= 0 and max(values) <= _INT64_MAX:
            return list(values)
    elif kind is numpy.ndarray and values.ndim == 1 and len(values) == size and \
            values.dtype.kind in "iu":
        out = values.tolist()
        if not size or (min(out) >= 0 and max(out) <= _INT64_MAX):
            return out
    try:  # any other input, or an error to word
        arr = numpy.asarray(values)
    except Exception:  # ragged or exotic input: report it, do not crash the vote
        raise TypeError(f"{name} on rank {rank} is not a sequence of integers") from None
    if arr.ndim != 1:
        if not hasattr(values, "__len__") and not hasattr(values, "shape"):
            raise TypeError(f"{name} on rank {rank} is not a sequence of integers "
                            f"(got {type(values).__name__})")
        raise ValueError(f"{name} on rank {rank} has shape {arr.shape}, expected ({size},) "
                         f"(one entry per rank)")
    if len(arr) != size:
        raise ValueError(f"{name} on rank {rank} has {len(arr)} entries, expected {size} "
                         f"(one per rank)")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} on rank {rank} must hold integers, got dtype {arr.dtype}")
    arr = arr.astype(numpy.int64, copy=False)
    if size and arr.min() < 0:
        r = int(numpy.argmin(arr))
        raise ValueError(f"{name} on rank {rank} is negative for rank {r}: {int(arr[r])}")
    return arr.tolist()


def exclusive_cumsum(counts):
    """Offsets of consecutive blocks of ``counts`` units: ``[0, c0, c0+c1, ...]`` (length W)."""
    return list(itertools.accumulate(counts, initial=0))[:-1]


def check_region(counts, offsets, rows, what, rank, explicit):
    """ValueError unless blocks ``[offsets[r], offsets[r] + counts[r])`` fit in ``rows`` rows:
    ``explicit`` offsets are checked for bounds and (``what="recv"``) overlaps; else the blocks
    must cover exactly ``rows``."""
    noun = "out" if what == "recv" else "send"
    if not explicit:
        total = sum(counts)
        if total != rows:
            raise ValueError(f"{what}_counts on rank {rank} add up to {total} rows, but {noun} "
                             f"has {rows} rows")
        return
    ends = list(map(operator.add, offsets, counts))
    if ends and max(ends) > rows:
        r = ends.index(max(ends))
        raise ValueError(f"{what}_offsets[{r}] + {what}_counts[{r}] = {offsets[r]} + "
                         f"{counts[r]} on rank {rank} runs past the {rows} rows of {noun}")
    if what == "recv":
        order = sorted((r for r, c in enumerate(counts) if c), key=offsets.__getitem__)
        for a, b in zip(order, order[1:]):
            if ends[a] > offsets[b]:
                raise ValueError(f"recv_offsets on rank {rank}: the blocks from ranks {a} and "
                                 f"{b} overlap in out")


def vote_counts(comm, op, error, send_counts, recv_counts, description, what, unit="rows"):
    """One agreement round (``comm.agree``), then the check that every rank expects what its peers
    send; returns ``sent[j][i]``, units rank j sends to rank i. Raises on every rank alike."""
    w = comm.size
    words = comm.agree(op, error, (0,) * 2 * w if error is not None else
                       (*send_counts, *recv_counts), text=description, what=what).tolist()
    sent = [row[:w] for row in words]
    verdict = counts_verdict(sent, [row[w:] for row in words], what, unit)
    if verdict is not None:
        raise verdict
    return sent


def rows_text(arrays):
    """What the ranks compare of arrays moved together, e.g. "bfloat16 rows of shape (7168,)"."""
    return " + ".join(f"{numpy.dtype(a.dtype).name} rows of shape {tuple(a.shape[1:])}"
                      for a in arrays)


def check_arrays(arrays, name, rank):
    """The rows of arrays moved together; ValueError unless at least 1-D, C-contiguous, equal
    rows."""
    rows = None
    for i, a in enumerate(arrays):
        label = name if len(arrays) == 1 else f"{name}[{i}]"
        if a.ndim < 1:
            raise ValueError(f"{label} on rank {rank} is 0-d; expected rows along the first axis")
        if not a.flags.c_contiguous:
            raise ValueError(f"{label} on rank {rank} must be C-contiguous")
        if rows is None:
            rows = a.shape[0]
        elif a.shape[0] != rows:
            raise ValueError(f"{label} on rank {rank} has {a.shape[0]} rows, {name}[0] {rows}: "
                             f"arrays moved together need equal rows")
    return rows


def _local_alltoallv(comm, send, send_counts, recv_counts, out, send_offsets, recv_offsets):
    """The local checks of an ``alltoallv`` call: ``(sends, outs, single, sc, rc, so, ro)``
    (``outs`` empty for None)."""
    rank, size = comm.rank, comm.size
    single = not isinstance(send, (tuple, list))
    sends = (comm._as_array(send, "send"),) if single else \
        tuple([comm._as_array(a, "send") for a in send])
    if not sends:
        raise ValueError("send is an empty tuple; expected one or more arrays")
    rows = check_arrays(sends, "send", rank)
    sc = as_counts(send_counts, "send_counts", rank, size)
    rc = as_counts(recv_counts, "recv_counts", rank, size)
    so = exclusive_cumsum(sc) if send_offsets is None else \
        as_counts(send_offsets, "send_offsets", rank, size)
    ro = exclusive_cumsum(rc) if recv_offsets is None else \
        as_counts(recv_offsets, "recv_offsets", rank, size)
    check_region(sc, so, rows, "send", rank, send_offsets is not None)
    outs = ()
    if out is not None:
        outs = tuple(comm._as_array(a, "out") for a in
                     ((out,) if not isinstance(out, (tuple, list)) else out))
        if len(outs) != len(sends):
            raise ValueError(f"out on rank {rank} holds {len(outs)} arrays, send {len(sends)}")
        out_rows = check_arrays(outs, "out", rank)
        for i, (s, o) in enumerate(zip(sends, outs)):
            at = "" if single else f"[{i}]"
            if o.dtype != s.dtype:
                raise TypeError(f"out{at} on rank {rank} has dtype {o.dtype}, send{at} "
                                f"{s.dtype}")
            if o.shape[1:] != s.shape[1:]:
                raise ValueError(f"out{at} on rank {rank} has rows of shape {o.shape[1:]}, "
                                 f"send{at} {s.shape[1:]}")
        check_region(rc, ro, out_rows, "recv", rank, recv_offsets is not None)
    elif recv_offsets is not None:
        check_region(rc, ro, max(map(operator.add, ro, rc), default=0), "recv", rank, True)
    return sends, outs, single, sc, rc, so, ro


def check_alltoallv(comm, send, send_counts, recv_counts, out, send_offsets, recv_offsets,
                    validate, descriptions):
    """Check an ``alltoallv`` call locally and, if ``validate``, across ranks; allocate ``out`` if
    None. ``descriptions``: the caller's cache of row texts. Returns ``(sends, outs, single, sc,
    rc, so, ro)``: backend arrays, whether ``send`` was one array, counts and offsets in rows."""
    error = None
    sends = outs = ()
    single, sc, rc, so, ro = True, None, None, None, None
    try:
        sends, outs, single, sc, rc, so, ro = _local_alltoallv(
            comm, send, send_counts, recv_counts, out, send_offsets, recv_offsets)
    except (TypeError, ValueError) as exc:
        error = exc
    if validate:
        description = ""
        if error is None:
            key = tuple([(a.dtype, a.shape[1:]) for a in sends])
            description = descriptions.get(key)
            if description is None:
                if len(descriptions) > 64:
                    descriptions.clear()
                description = descriptions[key] = rows_text(sends)
        vote_counts(comm, "alltoallv", error, sc, rc, description, "alltoallv")
    elif error is not None:
        raise type(error)(f"alltoallv: {error}")
    if not outs:
        nrows = max(map(operator.add, ro, rc), default=0) if recv_offsets is not None \
            else sum(rc)
        outs = tuple([comm._empty((nrows,) + a.shape[1:], a.dtype) for a in sends])
    return sends, outs, single, sc, rc, so, ro


def check_counts_array(comm, counts):
    """Check an ``alltoall_counts`` input locally and, if ``comm.validate``, across ranks:
    ``(counts, k)``, the backend array and its entries per rank."""
    error = None
    k = 0
    description = ""
    try:
        counts = comm._as_array(counts, "counts")
        if counts.ndim != 1 or counts.dtype.kind not in "iu":
            raise TypeError(f"counts on rank {comm.rank} must be a 1-D integer array, got "
                            f"{counts.ndim}-D {counts.dtype}")
        if counts.shape[0] % comm.size:
            raise ValueError(f"counts on rank {comm.rank} has {counts.shape[0]} entries, not a "
                             f"multiple of the {comm.size} ranks")
        k = counts.shape[0] // comm.size
        description = f"{counts.dtype.name} counts"
    except (TypeError, ValueError) as exc:
        error = exc
    if comm.validate:
        per_rank = None if error is not None else [k] * comm.size
        vote_counts(comm, "alltoall_counts", error, per_rank, per_rank, description,
                    "alltoall_counts", unit="entries")
    elif error is not None:
        raise error
    return counts, k


def counts_verdict(sent, expected, name, unit):
    """The ValueError every rank raises when some rank expects other counts than its peers send, or
    None. ``sent[j][i]``: units rank j sends to rank i; ``expected[i][j]``: units rank i expects
    from rank j."""
    if all(list(column) == row for row, column in zip(expected, zip(*sent))):
        return None
    pairs = [(i, j) for i, row in enumerate(expected) for j, e in enumerate(row)
             if e != sent[j][i]]
    i, j = pairs[0]
    text = (f"{name}: rank {i} expects {expected[i][j]} {unit} from rank {j}, but rank {j} "
            f"sends {sent[j][i]}")
    if len(pairs) > 1:
        text += f" ({len(pairs)} mismatched (receiver, sender) pairs in all)"
    return ValueError(text)
