"""Group arithmetic shared by every layer: which input columns share parameters, and how units fit in groups.

group_size -1 means one group per row; otherwise groups are group_size consecutive input columns, the last
one shorter when group_size does not divide the input width (SmolLM2's 576 at group size 128).
"""
import torch

from quantkit.core.errors import QuantkitError


def group_width(cols: int, group_size: int) -> int:
    """Columns per group; group_size -1 means one group per row. The last group may be shorter."""
    return cols if group_size == -1 else group_size


def n_groups(cols: int, group_size: int) -> int:
    return -(-cols // group_width(cols, group_size))


def group_index(cols: int, group_size: int) -> torch.Tensor:
    """g_idx: the group of each input column (i // group_size), int32."""
    return (torch.arange(cols) // group_width(cols, group_size)).to(torch.int32)


def row_groups(t: torch.Tensor, group_size: int):
    """A [K, cols] tensor's rows as views [groups, rows per group, cols], each with the slice of the [G, cols]
    parameters that go with it: the whole groups, then the shorter last one (if any). For plain g_idx only."""
    whole = t.shape[0] // group_size
    parts = [(t[:whole * group_size], slice(0, whole)), (t[whole * group_size:], slice(whole, None))]
    return [(rows.view(-1, min(group_size, rows.shape[0]), t.shape[1]), groups) for rows, groups in parts
            if rows.numel()]


def is_plain(g_idx: torch.Tensor, cols: int, group_size: int) -> bool:
    """Whether g_idx is the plain k // group_size (no act-order reordering)."""
    return torch.equal(g_idx.long().cpu(), group_index(cols, group_size).long())


def group_order(g_idx: torch.Tensor, cols: int, group_size: int):
    """None when g_idx is the plain k // group_size; the permutation sorting the inputs by group when that makes every
    group group_size consecutive inputs (act-order); False when it does not (groups of unequal sizes)."""
    if is_plain(g_idx, cols, group_size):
        return None
    g_idx = g_idx.long().cpu()
    perm = torch.argsort(g_idx, stable=True)
    return perm if torch.equal(g_idx[perm], group_index(cols, group_size).long()) else False


def check_shape(quantizer, cols: int, group_size: int, rows: int | None = None) -> None:
    """Units never straddle a group or the end of the row; a span of groups fitted together is always whole; a
    quantizer whose units span several rows (a trellis's tiles: its row_multiple) gets whole tiles of rows."""
    tile = getattr(quantizer, "row_multiple", 1)
    if rows is not None and rows % tile:
        raise QuantkitError(f"the {quantizer.name} quantizer rounds tiles of {tile} rows: it needs the output width "
                            f"({rows}) to be a multiple of {tile}")
    w = quantizer.width
    size = group_width(cols, group_size)
    if cols % w or size % w:
        raise QuantkitError(f"the {quantizer.name} quantizer rounds {w} columns at a time: it needs the input width "
                            f"({cols}) and the group size ({size}) to be multiples of {w}")
    span = size * getattr(quantizer, "span", 1)
    if span > size and cols % span:
        raise QuantkitError(f"the {quantizer.name} quantizer fits {span} columns at a time (a super-block): the input "
                            f"width ({cols}) is not a multiple of {span}")


def per_column(params: dict, g_idx: torch.Tensor) -> dict:
    """Group parameters [rows, groups] gathered to [rows, cols] by g_idx."""
    g = g_idx.long().to(next(iter(params.values())).device)
    return {k: v[:, g] for k, v in params.items()}
