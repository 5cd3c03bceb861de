"""Reference solutions to tutorial 08's exercises (REFIMPL_TUTORIAL_SOLUTIONS=1 selects them)."""


def zb1p_idle(pp, F, I, W):  # noqa: E741
    return (pp - 1) * (F + I - W)


def peak_activations(program, free_at):
    live = peak = 0
    for action in program:
        kind = action[0]
        if kind == "F":
            live += 1
            peak = max(peak, live)
        elif kind == "B" or kind == free_at:
            live -= 1
    return peak


def zb_h1(pp, m):
    programs = []
    for r in range(pp):
        warmup = min(pp - r - 1, m)
        steps = [f"F{k}" for k in range(warmup)]
        next_w = 0
        for k in range(m):
            if warmup + k < m:
                steps.append(f"F{warmup + k}")
            steps.append(f"I{k}")
            if k >= r:
                steps.append(f"W{next_w}")
                next_w += 1
        steps += [f"W{j}" for j in range(next_w, m)]
        programs.append(steps)
    return programs
