"""Reference solutions to tutorial 09's exercises (REFIMPL_TUTORIAL_SOLUTIONS=1 selects them)."""


def mesh_coordinates(rank, dp, pp, tp):
    t = rank % tp  # tp fastest: blocks of tp neighbouring ranks
    d = rank // tp % dp  # then dp: a stage's dp blocks, one per replica
    p = rank // (tp * dp)  # pp slowest: one stage per tp · dp ranks
    return d, p, t


def stage_layers(n_layer, num_stages):
    return [n_layer // num_stages + (1 if s < n_layer % num_stages else 0) for s in range(num_stages)]


def gradient_group(rank, dp, pp, schedule):
    p = rank // dp  # tp = 1: rank = p · dp + d
    same = {p, pp - 1 - p} if schedule == "dualpipe" else {p}
    return sorted(q * dp + e for e in range(dp) for q in same)
