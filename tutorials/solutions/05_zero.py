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


def zero3_bytes(module_sizes, n, P, G, K):  # noqa: N803
    # One flat buffer per module, padded to a multiple of N: each rank holds ⌈L/N⌉ of every module.
    return (P + G + K) * sum(max(1, -(-size // n)) for size in module_sizes)


ANSWER = """
Model answer to the question (measure and explain).

The ledger's Ψ′ − Ψ: N = 3 gives 0, 0, 0 and 15 for DP, ZeRO-1, ZeRO-2, ZeRO-3; N = 5 gives 0, 2, 2
and 32. Stages 1 and 2 pad one buffer per gradient bucket (one bucket here: ΨG = 106,752 bytes fits
1 MiB), so Ψ = 26,688 is padded once: 3 divides it, 5 needs 2 more. ZeRO-3 gathers a module at a
time, so it keeps one buffer per module that owns parameters (16 here), each padded on its own. At
N = 3 the wide layers (3,168, 1,056, 4,224, 4,128) divide; wte and lm_head (352) need 2 each, wpe
(512) 1, the five layer norms (64) 2 each: 15. At N = 5 nearly every module needs some: 32. The
bound is N − 1 per buffer, 16(N − 1): padding grows with the number of modules and with N, not with
the width. DP keeps whole buffers and pads nothing. The ledger equals (P+G+K)Ψ′/N to the byte, not
(P+G+K)Ψ/N, which at N = 5 is not even an integer (85,401.6): a rank holds its whole block,
padding included (exercise 4).
With --grad-accum 2 at N = 3 the counters give 35,584 elements for DP and ZeRO-1 (2Ψ(N−1)/N),
53,376 for ZeRO-2 ((g+1)Ψ(N−1)/N: a reduce-scatter per micro-batch, one all-gather) and 106,812 for
ZeRO-3 (3gΨ′(N−1)/N, Ψ′ = 26,703: each of its 3g = 6 collectives sends 17,802). ZeRO-3 keeps no
whole parameters or gradient between micro-batches, so all its traffic repeats per micro-batch:
with many micro-batches ZeRO-2 is the cheaper choice whenever its PΨ of whole parameters fits.
"""
