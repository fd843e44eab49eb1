"""The multiple-choice knapsack behind --target-bits: one option per item, the least summed cost within a budget.

Exact by dynamic programming over the budget in integer units. Sizes are rounded up to whole units, so a solution
never exceeds the budget; with a unit of 1 (sizes already whole, a budget of at most `resolution` units) it is the
exact optimum. A larger budget is cut into `resolution` units: the optimum of that rounded problem, which can leave at
most one unit per item unspent.
"""
import math

import numpy as np


def solve(costs: list, sizes: list, budget: int, resolution: int = 20000) -> list[int] | None:
    """The chosen option of each item (costs[i][j], sizes[i][j] for item i, option j; sizes in whole units of the
    budget, e.g. bytes; None: the item cannot take that option), minimizing the summed cost with the summed size ≤
    budget; None when no choice fits."""
    unit = max(1, math.ceil(budget / resolution))
    cap = budget // unit
    weights = [[cap + 1 if s is None else math.ceil(s / unit) for s in row] for row in sizes]
    if sum(min(row) for row in weights) > cap:
        return None
    best = np.zeros(cap + 1)  # least cost of the items so far within each capacity
    choices = []
    for cost_row, weight_row in zip(costs, weights):
        nxt = np.full(cap + 1, np.inf)
        pick = np.full(cap + 1, -1, dtype=np.int32)
        for j, (cost, w) in enumerate(zip(cost_row, weight_row)):
            if w > cap:
                continue
            candidate = np.full(cap + 1, np.inf)
            candidate[w:] = best[:cap + 1 - w] + cost
            better = candidate < nxt
            nxt[better], pick[better] = candidate[better], j
        best = nxt
        choices.append(pick)
    if not np.isfinite(best[cap]):
        return None
    chosen, c = [], cap
    for pick, weight_row in zip(reversed(choices), reversed(weights)):
        j = int(pick[c])
        chosen.append(j)
        c -= weight_row[j]
    return chosen[::-1]
