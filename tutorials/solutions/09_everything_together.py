"""Reference solutions to tutorial 09's exercises (REFIMPL_TUTORIAL_SOLUTIONS=1 selects them)."""


def mesh_coordinates(rank, dp, pp):
    return divmod(rank, pp)


def stage_layers(n_layer, num_stages):
    return [n_layer // num_stages + (1 if s < n_layer % num_stages else 0) for s in range(num_stages)]


def gradient_group(rank, dp, pp, schedule):
    p = rank % pp
    same = {p, pp - 1 - p} if schedule == "dualpipe" else {p}
    return sorted(d * pp + q for d in range(dp) for q in same)
