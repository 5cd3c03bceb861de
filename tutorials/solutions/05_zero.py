"""Reference solutions to tutorial 05's exercises (REFIMPL_TUTORIAL_SOLUTIONS=1 selects them)."""


def model_state_bytes(stage, psi, n, P, G, K):  # noqa: N803
    if stage == 0:
        return (P + G + K) * psi
    if stage == 1:
        return (P + G) * psi + K * psi / n
    if stage == 2:
        return P * psi + (G + K) * psi / n
    return (P + G + K) * psi / n


def shard_bounds(numel, n, rank):
    length = max(1, -(-numel // n)) * n
    block = length // n
    return length, rank * block, (rank + 1) * block


def sharded_update(optimizer, params, grads, n, states):
    block = len(params) // n
    for r in range(n):
        optimizer.update(params[r * block:(r + 1) * block], grads[r * block:(r + 1) * block], states[r])
